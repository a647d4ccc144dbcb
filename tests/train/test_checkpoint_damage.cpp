// A damaged checkpoint never loads wrong values: one bit of a tiny checkpoint flipped at a time
// — every byte of its HDF5 metadata (superblock, object headers, chunk indexes, link storage,
// attributes) and a sample of its data — must be refused by `dstrain-ckpt verify`
// (verify_checkpoint) and by a resume (Checkpointer::load), or read back bit for bit. Also the
// damage HDF5 cannot see: values, attributes and checksums rewritten through HDF5's own API
// (every Fletcher-32 valid), which only the end-to-end checksums catch.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <variant>

#include <fmt/format.h>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/rank_engine.h"

namespace dstrain::runtime {
namespace {
namespace fs = std::filesystem;

// A rank's whole state as the loader fills it.
struct Loaded {
  std::vector<float> dense, expert, buffers, moments;
  TrainState state;
  bool operator==(const Loaded& o) const {
    return dense == o.dense && expert == o.expert && buffers == o.buffers && moments == o.moments &&
           state.step == o.state.step && state.tokens_seen == o.state.tokens_seen &&
           state.loss_scale == o.state.loss_scale && state.scaler.iter == o.state.scaler.iter &&
           state.scaler.last_overflow_iter == o.state.scaler.last_overflow_iter &&
           state.scaler.hysteresis == o.state.scaler.hysteresis && state.scaler.skipped == o.state.scaler.skipped &&
           state.data_tokenizer == o.state.data_tokenizer && state.data_vocab_size == o.state.data_vocab_size;
  }
};

// The tiny model made smaller still (one MoE layer of two routed experts and a shared one,
// narrow), so that sweeping every metadata byte stays cheap; the file has every kind of object
// a checkpoint has, and with chunks of at most 256 elements (DSTRAIN_FAULT_INJECT
// ckpt_chunk_elements) its larger tensors span several chunks and so have chunk indexes.
struct Fixture {
  plan::ParallelPlan plan;
  RankEngine engine;
  std::unique_ptr<AdamW> adam;
  std::unique_ptr<Checkpointer> ck;
  std::string file;

  explicit Fixture(const std::string& dir)
      : plan(plan::make_plan(config::load_config_file(
                                 "configs/tiny.yaml",
                                 {"checkpoint.dir=" + dir, "checkpoint.resume=none", "model.hidden_size=16",
                                  "model.num_hidden_layers=1", "model.first_k_dense_replace=0",
                                  "model.num_nextn_predict_layers=0",
                                  "model.num_attention_heads=2", "model.num_key_value_heads=2",
                                  "model.q_lora_rank=8", "model.kv_lora_rank=8", "model.qk_nope_head_dim=4",
                                  "model.qk_rope_head_dim=4", "model.v_head_dim=4", "model.intermediate_size=16",
                                  "model.moe_intermediate_size=8", "model.n_routed_experts=2",
                                  "model.num_experts_per_tok=1", "model.n_group=1", "model.topk_group=1",
                                  "model.vocab_size=40"}),
                             1)) {
    engine = build_rank_engine(plan, RankGroups(plan), {1, false, 0, false});
    adam = std::make_unique<AdamW>(plan.config.optimizer, *engine.params, *engine.backend);
    engine.params->initialize(7, 0.02);
    // Moments with values of their own (2 p and p^2 + 1), so that a swap of tensors shows.
    for (auto [w, m, v] : {std::tuple{&engine.params->dense_params(), &adam->exp_avg_dense(), &adam->exp_avg_sq_dense()},
                           std::tuple{&engine.params->expert_params(), &adam->exp_avg_expert(),
                                      &adam->exp_avg_sq_expert()}})
      for (size_t i = 0; i < size_t(w->size()); ++i)
        m->host()[i] = 2 * w->host()[i], v->host()[i] = w->host()[i] * w->host()[i] + 1;
    ck = std::make_unique<Checkpointer>(plan, comm::ProcessGroup::self("world"));
    TrainState st;
    st.step = 3, st.tokens_seen = 1536, st.scaler.iter = 3, st.scaler.hysteresis = 2;
    st.data_tokenizer = "bytes", st.data_vocab_size = 256;
    ::setenv("DSTRAIN_FAULT_INJECT", "ckpt_chunk_elements:256", 1);
    file = ck->save(st, *engine.params, *adam);
    ::unsetenv("DSTRAIN_FAULT_INJECT");
  }

  // Loads `path` into fresh buffers: the loaded state, or the error's message.
  std::variant<Loaded, std::string> load(const std::string& path) {
    for (model::FlatArray<float>* a : {&engine.params->dense_params(), &engine.params->expert_params(),
                                       &engine.params->buffers(), &adam->moment(1, false), &adam->moment(1, true),
                                       &adam->moment(2, false), &adam->moment(2, true)})
      std::fill(a->host().begin(), a->host().end(), -1.0f);
    Loaded out;
    try {
      out.state = ck->load(path, *engine.params, adam.get());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    out.dense = engine.params->dense_params().to_host();
    out.expert = engine.params->expert_params().to_host();
    out.buffers = engine.params->buffers().to_host();
    for (int k = 1; k < 3; ++k)
      for (bool e : {false, true}) {
        const std::vector<float> m = adam->moment(k, e).to_host();
        out.moments.insert(out.moments.end(), m.begin(), m.end());
      }
    return out;
  }
};

std::vector<std::string> tensor_names(const io::H5File& f) {
  std::vector<std::string> out;
  for (const char* group : {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"})
    for (const std::string& n : f.list(group)) out.push_back(std::string(group) + "/" + n);
  return out;
}

// Every tensor of a checkpoint read whole through the checked reader ("" when one fails).
std::vector<std::vector<float>> read_all(const std::string& path) {
  int version = 0;
  const auto f = open_checkpoint_file(path, &version);
  std::vector<std::vector<float>> out;
  for (const std::string& ds : tensor_names(*f)) out.push_back(read_checked_tensor(*f, ds, version));
  return out;
}

// The CI's sample: the first 192 bytes and every 32nd metadata byte after them (the flipped bit
// moving with the byte's offset) and every 200th data byte, about 15 s on two cores; the full
// sweep, DSTRAIN_CKPT_DAMAGE_STRIDE=1, about ten minutes.
constexpr uint64_t kDefaultStride = 32;

void flip(const std::string& path, uint64_t offset, unsigned char mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.get(c);
  f.seekp(std::streamoff(offset));
  f.put(char(c ^ char(mask)));
}

TEST(CheckpointDamage, EveryMetadataByteAndASampleOfDataFlippedIsRefusedOrReadBitExact) {
  const std::string dir = "/dev/shm/dstrain-ckpt-damage-" + std::to_string(::getpid());
  fs::remove_all(dir);
  Fixture fx(dir);
  const auto want = fx.load(fx.file);
  ASSERT_TRUE(std::holds_alternative<Loaded>(want)) << std::get<std::string>(want);
  const std::vector<std::vector<float>> want_tensors = read_all(fx.file);

  // Which bytes are data: the stored chunks of every tensor; the rest is HDF5's metadata.
  const uint64_t size = fs::file_size(fx.file);
  std::vector<char> is_data(size, 0);
  int64_t multi_chunk = 0;  // tensors with a chunk index
  {
    io::H5File f(fx.file, io::H5File::Mode::kRead);
    for (const std::string& ds : tensor_names(f)) {
      const auto chunks = f.chunk_extents(ds);
      multi_chunk += chunks.size() > 1;
      for (const auto& [addr, bytes] : chunks)
        std::fill(is_data.begin() + std::ptrdiff_t(addr), is_data.begin() + std::ptrdiff_t(addr + bytes), 1);
    }
  }
  EXPECT_GE(multi_chunk, 6) << "too few tensors span several chunks for their indexes to be tested";
  // Every STRIDE-th metadata byte (DSTRAIN_CKPT_DAMAGE_STRIDE; 1: every one) and 0.5% of the data.
  const char* stride_env = std::getenv("DSTRAIN_CKPT_DAMAGE_STRIDE");
  const uint64_t stride = stride_env ? std::max(1, std::atoi(stride_env)) : kDefaultStride;
  std::vector<uint64_t> offsets;
  int64_t data_bytes = 0, metadata = 0;
  for (uint64_t i = 0; i < size; ++i) {
    if (is_data[i]) ++data_bytes;
    else ++metadata;
    // (the first 192 bytes, the superblock and the root group's object header, every one)
    if (is_data[i] ? (i * 2654435761u) % 199 == 0 : i < 192 || metadata % int64_t(stride) == 0) offsets.push_back(i);
  }
  ASSERT_GT(metadata, 8000) << "the metadata sweep would test little";
  ASSERT_GT(data_bytes, 20000);

  // Two worker processes (this machine's two cores), each on its own copy, every other byte;
  // each reports the failures it finds, then its counts, through a pipe. A worker that HDF5
  // crashes is a failure naming the byte it was on.
  constexpr int kWorkers = 2;
  struct Worker {
    pid_t pid;
    int fd;
  };
  std::vector<Worker> workers;
  const auto t0 = std::chrono::steady_clock::now();
  for (int w = 0; w < kWorkers; ++w) {
    int p[2];
    ASSERT_EQ(::pipe(p), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid > 0) {
      ::close(p[1]);
      workers.push_back({pid, p[0]});
      continue;
    }
    ::close(p[0]);
    FILE* out = ::fdopen(p[1], "w");
    const std::string work = fmt::format("{}/work{}.h5", dir, w);
    fs::copy_file(fx.file, work);
    int64_t refused = 0, intact = 0, wrong = 0;
    for (size_t n = size_t(w); n < offsets.size() && wrong < 20; n += kWorkers) {
      const uint64_t at = offsets[n];
      const unsigned char mask = static_cast<unsigned char>(1u << (at % 8));  // every bit position in turn
      const std::string where = fmt::format("byte {} ({}) bit {}", at, is_data[at] ? "data" : "metadata", at % 8);
      std::fprintf(out, "at %s\n", where.c_str());
      std::fflush(out);
      flip(work, at, mask);
      // dstrain-ckpt verify: refuses, or every tensor reads back as written.
      try {
        verify_checkpoint(work);
        if (read_all(work) != want_tensors) ++wrong, std::fprintf(out, "wrong %s: verify passed, tensors differ\n", where.c_str());
      } catch (const ConfigError&) {
      }
      // A resume: refuses with a message naming the file, or loads exactly the saved state.
      const auto got = fx.load(work);
      if (const auto* msg = std::get_if<std::string>(&got)) {
        ++refused;
        if (msg->find(work) == std::string::npos || msg->find('\n') != std::string::npos)
          ++wrong, std::fprintf(out, "wrong %s: the error is not one line naming the file: %s\n", where.c_str(),
                                msg->c_str());
      } else {
        ++intact;
        if (!(std::get<Loaded>(got) == std::get<Loaded>(want)))
          ++wrong, std::fprintf(out, "wrong %s: loaded wrong values\n", where.c_str());
      }
      flip(work, at, mask);  // undo
    }
    std::fprintf(out, "done %lld %lld\n", static_cast<long long>(refused), static_cast<long long>(intact));
    std::fclose(out);
    ::_exit(0);
  }
  int64_t refused = 0, intact = 0;
  for (const Worker& w : workers) {
    FILE* in = ::fdopen(w.fd, "r");
    char line[4096];
    std::string last;
    bool done = false;
    while (std::fgets(line, sizeof line, in)) {
      std::string l(line);
      if (!l.empty() && l.back() == '\n') l.pop_back();
      if (l.rfind("at ", 0) == 0) last = l.substr(3);
      else if (l.rfind("wrong ", 0) == 0) ADD_FAILURE() << l.substr(6);
      else if (long long r = 0, i = 0; std::sscanf(l.c_str(), "done %lld %lld", &r, &i) == 2) refused += r, intact += i, done = true;
    }
    std::fclose(in);
    int status = 0;
    ::waitpid(w.pid, &status, 0);
    if (!done) ADD_FAILURE() << "a worker died (status " << status << ") at " << last;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t data_flipped = std::count_if(offsets.begin(), offsets.end(), [&](uint64_t i) { return is_data[i]; });
  std::printf("flipped one bit in each of %zu bytes (%s of %lld metadata bytes: %lld; %lld of %lld data "
              "bytes) in %.1f s: %lld refused, %lld read back intact\n",
              offsets.size(), (stride == 1 ? std::string("every one") : fmt::format("one in {}", stride)).c_str(),
              static_cast<long long>(metadata), static_cast<long long>(int64_t(offsets.size()) - data_flipped),
              static_cast<long long>(data_flipped), static_cast<long long>(data_bytes), secs,
              static_cast<long long>(refused), static_cast<long long>(intact));
  EXPECT_EQ(refused + intact, int64_t(offsets.size()));
  EXPECT_GT(refused, int64_t(offsets.size()) / 2);
  fs::remove_all(dir);
}

// A root attribute replaced, as a number or a string.
void set_attr(hid_t f, const char* name, double v) {
  H5Adelete(f, name);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(f, name, H5T_NATIVE_DOUBLE, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(a, H5T_NATIVE_DOUBLE, &v), 0);
  H5Aclose(a);
  H5Sclose(space);
}
void set_attr(hid_t f, const char* name, const std::string& v) {
  H5Adelete(f, name);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, v.size());
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t a = H5Acreate2(f, name, type, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(a, type, v.c_str()), 0);
  H5Aclose(a);
  H5Sclose(space);
  H5Tclose(type);
}

// Rewrites through HDF5's own API: every chunk's Fletcher-32 is valid, only the end-to-end
// checksums can tell. Each edit must be refused by verify, by a resume and by the export, with
// one line naming the file and what is wrong.
class Rewritten : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = "/dev/shm/dstrain-ckpt-rewritten-" + std::to_string(::getpid());
    fs::remove_all(dir_);
    fx_ = new Fixture(dir_);
  }
  static void TearDownTestSuite() {
    delete fx_;
    fs::remove_all(dir_);
  }
  // A copy of the checkpoint edited by `edit` (an open read-write HDF5 file id).
  template <class Edit>
  std::string edited(const std::string& name, Edit&& edit) {
    const std::string path = dir_ + "/" + name + ".h5";
    fs::copy_file(fx_->file, path, fs::copy_options::overwrite_existing);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    EXPECT_GE(f, 0);
    edit(f);
    H5Fclose(f);
    return path;
  }
  void expect_refused(const std::string& path, const std::string& fragment) {
    const auto got = fx_->load(path);
    ASSERT_TRUE(std::holds_alternative<std::string>(got)) << path << " loaded";
    const std::string& msg = std::get<std::string>(got);
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    try {
      verify_checkpoint(path);
      ADD_FAILURE() << "verify passed " << path;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  }
  static void write_values(hid_t f, const std::string& ds, float value) {
    const hid_t d = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
    const hid_t space = H5Dget_space(d);
    std::vector<float> v(size_t(H5Sget_simple_extent_npoints(space)), value);
    EXPECT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
    H5Sclose(space);
    H5Dclose(d);
  }
  static inline std::string dir_;
  static inline Fixture* fx_ = nullptr;
};

// What a chunk read as missing gives (the chunk-index flip in the 1.8 format): zeros.
TEST_F(Rewritten, ZeroedTensorIsRefused) {
  const std::string p = edited("zeroed", [](hid_t f) { write_values(f, "model/model.layers.0.self_attn.kv_b_proj.weight", 0); });
  expect_refused(p, "tensor 'model/model.layers.0.self_attn.kv_b_proj.weight' does not match its checksum");
}

TEST_F(Rewritten, OneMomentValueChangedIsRefused) {
  const std::string ds = "optimizer/exp_avg_sq/model.layers.0.mlp.experts.1.up_proj.weight";
  const std::string p = edited("moment", [&](hid_t f) {
    const hid_t d = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
    const hid_t space = H5Dget_space(d);
    const hsize_t at[2] = {3, 5}, one[2] = {1, 1};
    H5Sselect_hyperslab(space, H5S_SELECT_SET, at, nullptr, one, nullptr);
    const hid_t mem = H5Screate_simple(2, one, nullptr);
    float x = 0;
    H5Dread(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &x);
    x = std::nextafter(x, 2.0f);  // one ulp
    EXPECT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &x), 0);
    H5Sclose(mem);
    H5Sclose(space);
    H5Dclose(d);
  });
  expect_refused(p, "tensor '" + ds + "' does not match its checksum");
}

// Two tensors of one shape trade places: each one's values are intact, under the other's name.
TEST_F(Rewritten, SwappedTensorsAreRefused) {
  const std::string a = "model/model.layers.0.mlp.experts.0.gate_proj.weight",
                    b = "model/model.layers.0.mlp.experts.1.gate_proj.weight";
  const std::string p = edited("swapped", [&](hid_t f) {
    EXPECT_GE(H5Lmove(f, a.c_str(), f, "model/tmp", H5P_DEFAULT, H5P_DEFAULT), 0);
    EXPECT_GE(H5Lmove(f, b.c_str(), f, a.c_str(), H5P_DEFAULT, H5P_DEFAULT), 0);
    EXPECT_GE(H5Lmove(f, "model/tmp", f, b.c_str(), H5P_DEFAULT, H5P_DEFAULT), 0);
  });
  expect_refused(p, "does not match its checksum");
}

TEST_F(Rewritten, ChangedRunAttributesAreRefused) {
  for (const char* attr : {"step", "seed", "loss_scale", "loss_scaler_hysteresis"}) {
    const std::string p = edited(std::string("attr_") + attr, [&](hid_t f) {
      set_attr(f, attr, 5.0);
    });
    expect_refused(p, "run attributes (step, seed, config, ...) do not match their checksum");
  }
  const std::string p = edited("attr_config", [](hid_t f) {
    set_attr(f, "config_yaml", std::string("train_steps: 1\n"));
  });
  expect_refused(p, "run attributes (step, seed, config, ...) do not match their checksum");
}

TEST_F(Rewritten, MissingChecksumsAreRefused) {
  const std::string ds = "model/model.norm.weight";
  std::string p = edited("no_tensor_sum", [&](hid_t f) { EXPECT_GE(H5Adelete_by_name(f, ds.c_str(), "checksum", H5P_DEFAULT), 0); });
  expect_refused(p, "tensor '" + ds + "' has no readable checksum");
  p = edited("no_attr_sum", [](hid_t f) { EXPECT_GE(H5Adelete(f, "attributes_checksum"), 0); });
  expect_refused(p, "run attributes have no readable checksum");
}

// A file of format version 1 (before the checksums) still loads, bit for bit.
TEST_F(Rewritten, VersionOneFilesLoadWithoutChecksums) {
  const std::string p = edited("v1", [](hid_t f) {
    set_attr(f, "format_version", 1.0);
    EXPECT_GE(H5Adelete(f, "attributes_checksum"), 0);
  });
  const auto want = fx_->load(fx_->file), got = fx_->load(p);
  ASSERT_TRUE(std::holds_alternative<Loaded>(got)) << std::get<std::string>(got);
  EXPECT_TRUE(std::get<Loaded>(got) == std::get<Loaded>(want));
  int version = 0;
  EXPECT_EQ(verify_checkpoint(p, &version), 67);
  EXPECT_EQ(version, 1);
}

}  // namespace
}  // namespace dstrain::runtime
