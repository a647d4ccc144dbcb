// dstrain-ckpt: look into and convert dstrain checkpoints.
//   dstrain-ckpt info PATH              step, tokens, layout, format, config, tensor table
//   dstrain-ckpt verify PATH            reads every tensor and checks its checksum
//   dstrain-ckpt diff A B               per-tensor max |difference| of two checkpoints
//   dstrain-ckpt export-hf PATH OUT_DIR config.json + model.safetensors for Hugging Face
//   dstrain-ckpt import-hf HF_DIR OUT   a Hugging Face DeepSeek model directory (config.json,
//                                       safetensors) -> a weights-only checkpoint OUT that any
//                                       layout starts from (checkpoint.resume: OUT)
//   dstrain-ckpt compare-dumps A B TOL  two `dstrain --dump-grads` files: every weight and
//                                       gradient tensor, and the losses, within TOL relative
//                                       (to the tensor's largest magnitude in A)
// PATH is a checkpoint file or a checkpoint directory (its `latest`). Exit status: 0 fine (diff:
// identical; compare-dumps: within TOL), 1 an error or tensors that differ or are missing, 2 a
// bad command line.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/common/error.h"
#include "engine/common/host_memory.h"
#include "engine/common/strings.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/hf_import.h"

namespace {

using dstrain::io::H5File;
namespace fs = std::filesystem;

const char* kUsage =
    "usage: dstrain-ckpt info PATH\n"
    "       dstrain-ckpt verify PATH\n"
    "       dstrain-ckpt diff A B\n"
    "       dstrain-ckpt export-hf PATH OUT_DIR\n"
    "       dstrain-ckpt import-hf HF_DIR OUT.h5\n"
    "       dstrain-ckpt compare-dumps A.h5 B.h5 TOL   (files of dstrain --dump-grads)\n"
    "PATH: a checkpoint file, or a checkpoint directory (its latest)\n";

std::string resolve(const std::string& path) {
  if (fs::is_directory(path)) {
    const std::string p = dstrain::runtime::latest_checkpoint(path);
    if (p.empty()) throw dstrain::ConfigError(fmt::format("{}: no `latest` checkpoint in this directory", path));
    return p;
  }
  if (!fs::exists(path)) throw dstrain::ConfigError(fmt::format("{}: no such checkpoint", path));
  return path;
}

// A checkpoint opened for whole-tensor reads, its run attributes' checksum checked.
struct Opened {
  std::unique_ptr<H5File> file;
  int version = 0;
  std::vector<float> tensor(const std::string& dataset) const {
    return dstrain::runtime::read_checked_tensor(*file, dataset, version);
  }
};
Opened open_checkpoint(const std::string& path) {
  Opened o;
  o.file = dstrain::runtime::open_checkpoint_file(path, &o.version);
  return o;
}

std::string shape_text(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

int info(const std::string& arg) {
  const std::string path = resolve(arg);
  const Opened o = open_checkpoint(path);
  const H5File* f = o.file.get();
  std::printf("checkpoint %s (%s)\n", path.c_str(), dstrain::human_bytes(double(fs::file_size(path))).c_str());
  std::printf("format     dstrain-checkpoint version %d%s\n", o.version,
              o.version >= 2 ? " (end-to-end checksums)" : " (no end-to-end checksums)");
  std::printf("step       %s (%s tokens seen)\n", dstrain::with_commas(int64_t(f->attr_double("step"))).c_str(),
              dstrain::with_commas(int64_t(f->attr_double("tokens_seen"))).c_str());
  // (text from the file is printed escaped: a crafted checkpoint reaches no terminal control)
  std::printf("layout     %s\n", dstrain::printable(f->attr_string("layout")).c_str());
  std::printf("optimizer  %s (exp_avg, exp_avg_sq per parameter); loss scale %g\n",
              dstrain::printable(f->attr_string("optimizer")).c_str(), f->attr_double("loss_scale"));
  int64_t count = 0, elements = 0;
  std::printf("tensors (model/, fp32, full shapes):\n");
  for (const std::string& name : f->list("model")) {
    const auto s = f->shape("model/" + name);
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    ++count, elements += n;
    std::printf("  %-64s %-16s %s\n", dstrain::printable(name).c_str(), shape_text(s).c_str(),
                dstrain::human_bytes(4.0 * double(n)).c_str());
  }
  std::printf("%s tensors, %s elements (%s); optimizer state %s tensors\n", dstrain::with_commas(count).c_str(),
              dstrain::with_commas(elements).c_str(), dstrain::human_bytes(4.0 * double(elements)).c_str(),
              dstrain::runtime::weights_only(*f)
                  ? "none: weights only (fresh optimizer state and schedule at a start from it),"
                  : dstrain::with_commas(int64_t(f->list("optimizer/exp_avg").size() * 2)).c_str());
  std::string config;
  for (const std::string& line : dstrain::split(f->attr_string("config_yaml"), '\n'))
    config += dstrain::printable(line, 4096) + "\n";
  while (config.size() >= 2 && config.substr(config.size() - 2) == "\n\n") config.pop_back();
  std::printf("config:\n%s", config.c_str());
  return 0;
}

int diff(const std::string& a_arg, const std::string& b_arg) {
  const Opened oa = open_checkpoint(resolve(a_arg)), ob = open_checkpoint(resolve(b_arg));
  const H5File *a = oa.file.get(), *b = ob.file.get();
  double worst = 0;
  int differing = 0, missing = 0;
  // A weights-only checkpoint (import-hf) has no optimizer state: then the weights are compared.
  const bool weights = dstrain::runtime::weights_only(*a) || dstrain::runtime::weights_only(*b);
  if (weights) std::printf("weights only (a checkpoint without optimizer state): comparing model/ alone\n");
  for (const char* group : {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"}) {
    if (weights && group[0] == 'o') continue;
    const auto names = a->list(group);
    for (const std::string& name : names) {
      const std::string ds = std::string(group) + "/" + name;
      if (!b->exists(ds)) {
        std::printf("%-80s only in A\n", ds.c_str());
        ++missing;
        continue;
      }
      if (a->shape(ds) != b->shape(ds)) {
        std::printf("%-80s shapes %s vs %s\n", ds.c_str(), shape_text(a->shape(ds)).c_str(), shape_text(b->shape(ds)).c_str());
        ++missing;
        continue;
      }
      const auto x = oa.tensor(ds), y = ob.tensor(ds);
      double d = 0;
      for (size_t i = 0; i < x.size(); ++i) d = std::max(d, double(std::fabs(x[i] - y[i])));
      if (d > 0) {
        std::printf("%-80s max |A-B| %.6g\n", ds.c_str(), d);
        ++differing;
      }
      worst = std::max(worst, d);
    }
    for (const std::string& name : b->list(group))
      if (!a->exists(std::string(group) + "/" + name)) {
        std::printf("%s/%-74s only in B\n", group, name.c_str());
        ++missing;
      }
  }
  std::printf("%d tensors differ (largest difference %.6g), %d missing or reshaped; steps %g and %g\n", differing,
              worst, missing, a->attr_double("step"), b->attr_double("step"));
  return differing + missing == 0 ? 0 : 1;  // as diff(1)
}

// Two --dump-grads files (the same model and batch, e.g. on two backends or layouts).
int compare_dumps(const std::string& a_path, const std::string& b_path, const std::string& tol_arg) {
  char* end = nullptr;
  const double tol = std::strtod(tol_arg.c_str(), &end);
  if (tol_arg.empty() || *end != '\0' || !(tol >= 0) || !std::isfinite(tol))
    throw dstrain::ConfigError(fmt::format("compare-dumps: TOL '{}' is not a number >= 0 (e.g. 1e-5)",
                                           dstrain::printable(tol_arg, 40)));
  H5File a(a_path, H5File::Mode::kRead), b(b_path, H5File::Mode::kRead);
  int over = 0, missing = 0, tensors = 0;
  for (const char* group : {"weights", "grads"}) {
    double group_worst = 0;
    std::string worst_name;
    for (const std::string& name : a.list(group)) {
      const std::string ds = std::string(group) + "/" + name;
      if (!b.exists(ds) || a.shape(ds) != b.shape(ds)) {
        std::printf("%-70s missing or reshaped in B\n", ds.c_str());
        ++missing;
        continue;
      }
      const auto x = a.read_floats(ds), y = b.read_floats(ds);
      double scale = 1e-30, d = 0;
      for (float v : x) scale = std::max(scale, double(std::fabs(v)));
      for (size_t i = 0; i < x.size(); ++i) {
        const double e = std::fabs(double(x[i]) - double(y[i]));
        d = std::isnan(e) ? INFINITY : std::max(d, e);
      }
      const double rel = d / scale;
      ++tensors;
      if (rel > tol) {
        std::printf("%-70s relative difference %.3g > %.3g\n", ds.c_str(), rel, tol);
        ++over;
      }
      if (rel >= group_worst) group_worst = rel, worst_name = name;
    }
    std::printf("%s: largest relative difference %.3g (%s)\n", group, group_worst, worst_name.c_str());
  }
  for (const char* attr : {"ce_loss", "aux_loss", "mtp_loss"}) {
    const double x = a.attr_double(attr), y = b.attr_double(attr);
    const double rel = std::fabs(x - y) / std::max(std::fabs(x), 1e-30);
    std::printf("%s: %.9g vs %.9g (relative %.3g)\n", attr, x, y, rel);
    if (x != 0 && rel > tol) ++over;
  }
  std::printf("%d tensors compared: %d over %.3g, %d missing\n", tensors, over, tol, missing);
  return over + missing == 0 && tensors > 0 ? 0 : 1;
}

int verify(const std::string& arg) {
  const std::string path = resolve(arg);
  int version = 0;
  const int64_t tensors = dstrain::runtime::verify_checkpoint(path, &version);
  if (version >= 2)
    std::printf("%s: ok, %s tensors read, every checksum verified (each chunk's and each tensor's, and the run "
                "attributes')\n",
                path.c_str(), dstrain::with_commas(tensors).c_str());
  else
    std::printf("%s: ok, %s tensors read, each chunk's checksum verified (format version %d: no end-to-end "
                "checksums)\n",
                path.c_str(), dstrain::with_commas(tensors).c_str(), version);
  return 0;
}

// safetensors: 8-byte little-endian header size, a JSON header with dtype, shape and byte
// offsets per tensor, then the raw little-endian data.
// Writes into a fresh directory next to OUT_DIR and renames it into place only when complete: a
// bad checkpoint or a failed write leaves no partial export behind.
int export_hf(const std::string& arg, const std::string& final_dir) {
  const std::string path = resolve(arg);
  const Opened o = open_checkpoint(path);
  const H5File* f = o.file.get();
  if (fs::exists(final_dir) && !fs::is_empty(final_dir))
    throw dstrain::ConfigError(fmt::format("{} exists and is not empty; valid: a new or empty directory", final_dir));
  const std::string out_dir = final_dir + ".tmp";
  fs::remove_all(out_dir);
  fs::create_directories(out_dir);
  struct Cleanup {  // on any error: remove the partial export
    std::string dir;
    bool done = false;
    ~Cleanup() {
      std::error_code ec;
      if (!done) fs::remove_all(dir, ec);
    }
  } cleanup{out_dir};
  {
    std::ofstream cfg(fs::path(out_dir) / "config.json");
    cfg << f->attr_string("hf_config");
    if (!cfg.flush()) throw dstrain::Error(fmt::format("{}: cannot write config.json", out_dir));
  }
  const auto names = f->list("model");
  nlohmann::ordered_json meta;
  meta["__metadata__"] = {{"format", "pt"}, {"source", "dstrain"}};
  int64_t offset = 0;
  for (const std::string& name : names) {
    const auto s = f->shape("model/" + name);
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    meta[name] = {{"dtype", "F32"}, {"shape", s}, {"data_offsets", {offset, offset + 4 * n}}};
    offset += 4 * n;
  }
  std::string header = meta.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::string out = (fs::path(out_dir) / "model.safetensors").string(), tmp = out + ".tmp";
  {
    std::ofstream st(tmp, std::ios::binary);
    const uint64_t len = header.size();
    st.write(reinterpret_cast<const char*>(&len), 8);
    st.write(header.data(), std::streamsize(header.size()));
    for (const std::string& name : names) {
      std::vector<float> data;
      try {
        data = o.tensor("model/" + name);
      } catch (const dstrain::Error& e) {
        throw dstrain::ConfigError(fmt::format("{}; nothing was exported", e.what()));
      }
      st.write(reinterpret_cast<const char*>(data.data()), std::streamsize(4 * data.size()));
    }
    if (!st.flush()) throw dstrain::Error(fmt::format("{}: write failed", tmp));
  }
  fs::rename(tmp, out);
  if (fs::exists(final_dir)) fs::remove(final_dir);  // empty (checked above)
  fs::rename(out_dir, final_dir);
  cleanup.done = true;
  std::printf("wrote %s/config.json and model.safetensors (%zu tensors, %s) from %s\n", final_dir.c_str(), names.size(),
              dstrain::human_bytes(double(offset)).c_str(), path.c_str());
  return 0;
}

int import_hf(const std::string& hf_dir, const std::string& out) {
  const dstrain::runtime::HfImport r = dstrain::runtime::import_hf_checkpoint(hf_dir, out);
  const dstrain::config::ModelConfig& m = r.model;
  std::printf("wrote %s: %s tensors (%s of fp32; read as %s) from %s, weights only\n", out.c_str(),
              dstrain::with_commas(r.tensors).c_str(), dstrain::human_bytes(r.bytes).c_str(),
              fmt::format("{}", fmt::join(r.dtypes, ", ")).c_str(), hf_dir.c_str());
  std::printf("model: %s, %lld layers, hidden %lld, %lld routed experts, vocabulary %lld\n",
              dstrain::config::to_string(m.model_type).c_str(), (long long)m.num_hidden_layers, (long long)m.hidden_size,
              (long long)m.num_routed(), (long long)m.vocab_size);
  if (r.mtp_dropped)
    std::printf("note: config.json asks for multi-token-prediction layers the files do not hold (transformers does "
                "not save them): imported without them (model.num_nextn_predict_layers: 0)\n");
  if (!r.ignored_keys.empty())
    std::printf("config.json keys dstrain's model does not use (ignored): %s\n",
                fmt::format("{}", fmt::join(r.ignored_keys, ", ")).c_str());
  std::printf("start a run from it with checkpoint.resume: %s (its model section must match: `dstrain-ckpt info "
              "%s` prints it)\n",
              out.c_str(), out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dstrain::tune_host_allocator();
  const std::vector<std::string> a(argv + 1, argv + argc);
  try {
    if (a.size() == 2 && a[0] == "info") return info(a[1]);
    if (a.size() == 2 && a[0] == "verify") return verify(a[1]);
    if (a.size() == 3 && a[0] == "diff") return diff(a[1], a[2]);
    if (a.size() == 3 && a[0] == "export-hf") return export_hf(a[1], a[2]);
    if (a.size() == 3 && a[0] == "import-hf") return import_hf(a[1], a[2]);
    if (a.size() == 4 && a[0] == "compare-dumps") return compare_dumps(a[1], a[2], a[3]);
    std::fputs(kUsage, stderr);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dstrain-ckpt: error: %s\n", e.what());
    return 1;
  }
}
