// libFuzzer target: the checkpoint reader. A valid checkpoint of the tiny model is written once;
// each input is a list of edits to a copy of it — tensors deleted, reshaped or filled with
// NaN / Inf / huge values, root attributes replaced by other numbers or strings, the file cut
// short — after which `dstrain-ckpt verify` (verify_checkpoint) and a resume (Checkpointer::load)
// must end in success or a dstrain::Error with a message: never a crash, another exception or
// undefined behaviour. The edits go through HDF5's own API, so the files stay well-formed HDF5:
// what is fuzzed is dstrain's reading of them, not the HDF5 library's parser. Run from the
// repository root.
#include <hdf5.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/rank_engine.h"

namespace {

namespace fs = std::filesystem;
using namespace dstrain;

struct Base {
  plan::ParallelPlan plan;
  runtime::RankEngine engine;
  std::unique_ptr<runtime::AdamW> adam;
  std::string file;
  std::vector<std::string> datasets;  // "model/..." and "optimizer/..." paths
};

Base& base() {
  static Base b = [] {
    const std::string dir = "/tmp/dstrain-fuzz-ckpt-" + std::to_string(getpid());
    fs::remove_all(dir);
    const config::TrainConfig cfg = config::load_config_file(
        "configs/tiny.yaml", {"checkpoint.dir=" + dir, "checkpoint.resume=none", "checkpoint.keep_last=1"});
    Base out{plan::make_plan(cfg, 1), {}, nullptr, "", {}};
    return out;
  }();
  if (b.file.empty()) {
    b.engine = runtime::build_rank_engine(b.plan, runtime::RankGroups(b.plan), {1, false, 0, false});
    b.adam = std::make_unique<runtime::AdamW>(b.plan.config.optimizer, *b.engine.params, *b.engine.backend);
    runtime::Checkpointer ck(b.plan, comm::ProcessGroup::self("world"));
    runtime::TrainState st;
    st.step = 3;
    b.file = ck.save(st, *b.engine.params, *b.adam);
    for (const auto& p : b.plan.params) {
      b.datasets.push_back("model/" + p.name);
      if (!p.buffer) b.datasets.push_back("optimizer/exp_avg/" + p.name), b.datasets.push_back("optimizer/exp_avg_sq/" + p.name);
    }
  }
  return b;
}

// Reads the input byte by byte; 0 once it is used up.
struct Bytes {
  const uint8_t* p;
  size_t n, at = 0;
  uint8_t next() { return at < n ? p[at++] : 0; }
  bool more() const { return at < n; }
};

void replace_dataset(hid_t f, const std::string& name, Bytes& in) {
  H5Ldelete(f, name.c_str(), H5P_DEFAULT);
  const int rank = 1 + in.next() % 3;
  hsize_t dims[3];
  hsize_t count = 1;
  for (int i = 0; i < rank; ++i) count *= (dims[i] = in.next() % 70);
  std::vector<float> values(count, 0.5f);
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  const hid_t type = in.next() % 4 == 0 ? H5T_NATIVE_INT : H5T_NATIVE_FLOAT;  // a wrong element type too
  const hid_t space = H5Screate_simple(rank, dims, nullptr);
  const hid_t ds = H5Dcreate2(f, name.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  if (ds >= 0) {
    if (type == H5T_NATIVE_FLOAT && count > 0) H5Dwrite(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
    H5Dclose(ds);
  }
  H5Sclose(space);
  H5Pclose(lcpl);
}

void fill_dataset(hid_t f, const std::string& name, Bytes& in) {
  const hid_t ds = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  if (ds < 0) return;
  const hid_t space = H5Dget_space(ds);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  const float values[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 3e38f,
                          -0.0f};
  std::vector<float> data(size_t(std::max<hssize_t>(n, 0)), values[in.next() % 4]);
  if (n > 0) H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data());
  H5Sclose(space);
  H5Dclose(ds);
}

void set_attribute(hid_t f, Bytes& in) {
  static const char* names[] = {"format", "format_version", "step", "tokens_seen", "loss_scale",
                                "data_tokenizer", "data_vocab_size", "config_yaml"};
  const char* name = names[in.next() % 8];
  H5Adelete(f, name);
  if (in.next() % 2) {
    const double values[] = {-1.0, 0.0, 1e300, std::nan(""), 2.0, 9e18};
    const double v = values[in.next() % 6];
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, name, H5T_NATIVE_DOUBLE, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, H5T_NATIVE_DOUBLE, &v), H5Aclose(a);
    H5Sclose(space);
  } else {
    std::string s;
    for (int i = in.next() % 16; i > 0; --i) s.push_back(char(in.next()));
    const hid_t type = H5Tcopy(H5T_C_S1);
    H5Tset_size(type, s.size() + 1);
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
    if (a >= 0) H5Awrite(a, type, s.c_str()), H5Aclose(a);
    H5Sclose(space);
    H5Tclose(type);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Base& b = base();
  const std::string work = b.file + ".work-" + std::to_string(getpid());
  fs::copy_file(b.file, work, fs::copy_options::overwrite_existing);
  Bytes in{data, size};
  uintmax_t cut = 0;
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  const hid_t f = H5Fopen(work.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) __builtin_trap();  // the copy of a valid checkpoint must open
  for (int edits = 0; in.more() && edits < 8; ++edits) {
    const uint8_t op = in.next() % 5;
    const std::string& ds = b.datasets[(size_t(in.next()) << 8 | in.next()) % b.datasets.size()];
    if (op == 0) H5Ldelete(f, ds.c_str(), H5P_DEFAULT);
    else if (op == 1) replace_dataset(f, ds, in);
    else if (op == 2) fill_dataset(f, ds, in);
    else if (op == 3) set_attribute(f, in);
    else cut = 1 + in.next();  // cut the file to cut/257 of its size after closing
  }
  H5Fclose(f);
  if (cut) fs::resize_file(work, fs::file_size(work) * cut / 257);
  try {
    runtime::verify_checkpoint(work);
  } catch (const dstrain::Error& e) {
    if (std::string(e.what()).empty()) __builtin_trap();
  }
  try {
    runtime::Checkpointer ck(b.plan, comm::ProcessGroup::self("world"));
    ck.load(work, *b.engine.params, b.adam.get());
  } catch (const dstrain::Error& e) {
    if (std::string(e.what()).empty()) __builtin_trap();
  }
  fs::remove(work);
  return 0;
}
