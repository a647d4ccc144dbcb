// Checkpoints in one process: round trip, bit-exact resume, latest / keep_last, async writes,
// and every fault that must be named at load.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/trainer.h"

namespace dstrain::runtime {
namespace {
namespace fs = std::filesystem;

// A directory of the running test's own: CTest runs this file's tests in parallel processes, and
// two of them in one directory collide on its lock (a shared "load_target" failed so in CI).
std::string fresh_dir(const std::string& name) {
  const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string d = ::testing::TempDir() + "/ckpt_" + (t ? std::string(t->name()) + "_" : "") + name;
  fs::remove_all(d);
  return d;
}

plan::ParallelPlan tiny_plan(const std::string& dir, std::vector<std::string> sets = {}) {
  sets.push_back("checkpoint.dir=" + dir);
  sets.push_back("data.eval_interval=0");
  sets.push_back("monitor.expert_stats_interval=0");
  return plan::make_plan(config::load_config_file("configs/tiny.yaml", sets), 1);
}

// 20 steps straight == 10 steps, save, a fresh process resumes, 10 steps: bitwise.
TEST(Checkpoint, ResumeIsBitExactOnTheSameLayout) {
  const std::string dir = fresh_dir("bitexact");
  const plan::ParallelPlan straight_plan = tiny_plan(dir + "/a", {"checkpoint.resume=none"});
  Trainer straight(straight_plan, 2);
  std::vector<double> losses;
  for (int64_t s = 0; s < 20; ++s) losses.push_back(straight.train_step(s).loss.ce);

  const plan::ParallelPlan first_plan = tiny_plan(dir + "/b", {"checkpoint.resume=none"});
  std::string path;
  {
    Trainer first(first_plan, 2);
    for (int64_t s = 0; s < 10; ++s) EXPECT_EQ(first.train_step(s).loss.ce, losses[s]);
    path = first.save_checkpoint(10);
  }
  const plan::ParallelPlan second_plan = tiny_plan(dir + "/c", {"checkpoint.resume=" + path});
  Trainer second(second_plan, 2);
  ASSERT_EQ(second.start_step(), 10);
  for (int64_t s = 10; s < 20; ++s) EXPECT_EQ(second.train_step(s).loss.ce, losses[s]) << "step " << s + 1;
  EXPECT_EQ(second.params().dense_params().to_host(), straight.params().dense_params().to_host());
  EXPECT_EQ(second.params().expert_params().to_host(), straight.params().expert_params().to_host());
  EXPECT_EQ(second.params().buffers().to_host(), straight.params().buffers().to_host());  // router biases
}

// Mixed precision keeps no fp32 copy of the compute weights (docs/design.md §6.10): once built,
// the store's fp32 buffers are gone, the GEMMs' weights and the embedding exist as 16-bit values
// only, the tensors read in fp32 (norms, routers) a widened side copy of theirs, and AdamW's
// master weights are the only fp32 weights; a resume rebuilds all of it bit for bit.
TEST(Checkpoint, MixedPrecisionHoldsNoFp32CopyAndResumesBitExact) {
  const std::string dir = fresh_dir("bf16");
  const auto bf16 = [&](const std::string& sub, const std::string& resume) {
    return tiny_plan(dir + "/" + sub, {"checkpoint.resume=" + resume, "bf16.enabled=true"});
  };
  const plan::ParallelPlan straight_plan = bf16("a", "none");
  Trainer straight(straight_plan, 2);
  model::ParamStore& ps = straight.params();
  EXPECT_FALSE(ps.holds_fp32());
  EXPECT_EQ(ps.params(false).size() + ps.params(true).size(), 0);
  int64_t side = 0;
  for (const std::string& name : ps.names()) {
    const model::ParamView& v = ps.view(name);
    if (v.buffer) continue;
    const bool fp32 = model::ParamStore::reads_fp32(v);
    EXPECT_EQ(ps.param(name) != nullptr, fp32) << name;
    EXPECT_EQ(ps.compute_param(name) != nullptr, !fp32) << name;
    if (!fp32) continue;
    side += v.numel;
    const float* p = ps.param(name);  // host memory on the CPU
    EXPECT_EQ(std::vector<float>(p, p + v.numel), ps.local_values(name)) << name;
  }
  EXPECT_GT(side, 0);
  // 2 bytes per parameter, plus the side copies and the router biases (buffers).
  const double per_param = double(ps.weight_bytes() - 4 * ps.buffers().size()) / double(ps.num_params());
  EXPECT_LT(per_param, 2.0 + 4.0 * double(side + 16 * 64) / double(ps.num_params()) + 0.01) << per_param;
  std::vector<double> losses;
  for (int64_t s = 0; s < 6; ++s) losses.push_back(straight.train_step(s).loss.ce);

  std::string path;
  {
    const plan::ParallelPlan first_plan = bf16("b", "none");
    Trainer first(first_plan, 2);
    for (int64_t s = 0; s < 3; ++s) EXPECT_EQ(first.train_step(s).loss.ce, losses[s]);
    path = first.save_checkpoint(3);
  }
  const plan::ParallelPlan second_plan = bf16("c", path);
  Trainer second(second_plan, 2);
  ASSERT_EQ(second.start_step(), 3);
  for (int64_t s = 3; s < 6; ++s) EXPECT_EQ(second.train_step(s).loss.ce, losses[s]) << "step " << s + 1;
  for (const bool expert : {false, true})
    EXPECT_EQ(second.params().compute_copy(expert).to_host(), ps.compute_copy(expert).to_host());
  for (const std::string& name : ps.names()) EXPECT_EQ(second.params().local_values(name), ps.local_values(name)) << name;
}

TEST(Checkpoint, LatestPointsAtTheNewestAndOldOnesArePruned) {
  const std::string dir = fresh_dir("prune");
  const plan::ParallelPlan p = tiny_plan(dir, {"train_steps=8", "checkpoint.interval=2", "checkpoint.keep_last=2",
                                              "checkpoint.resume=none", "steps_per_print=100"});
  {
    Trainer t(p, 1);
    t.run();
  }  // (its lock on the directory is released)
  const auto files = list_checkpoints(dir);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(fs::path(files[0]).filename(), "step_00000006.h5");
  EXPECT_EQ(latest_checkpoint(dir), dir + "/step_00000008.h5");
  // A rerun with resume: auto continues from there: nothing left to do at train_steps 8.
  const plan::ParallelPlan again = tiny_plan(dir, {"train_steps=8", "checkpoint.resume=auto"});
  Trainer t2(again, 1);
  EXPECT_EQ(t2.start_step(), 8);
  // The file is readable without dstrain's reader too: HF names at full shape, attributes.
  io::H5File f(files[1], io::H5File::Mode::kRead);
  EXPECT_EQ(f.shape("model/model.layers.1.mlp.experts.3.down_proj.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(f.shape("optimizer/exp_avg_sq/lm_head.weight"), (std::vector<int64_t>{256, 64}));
  EXPECT_FALSE(f.exists("optimizer/exp_avg/model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_EQ(f.attr_double("step"), 8.0);
  EXPECT_EQ(f.attr_double("format_version"), 2.0);
  EXPECT_EQ(f.attr_string("layout"), "tensor=1 pipeline=1 data=1 expert=1 world=1");
  EXPECT_NE(f.attr_string("config_yaml").find("train_steps: 8"), std::string::npos);
}

// Starting afresh in a directory that holds later steps must not prune the new checkpoint.
TEST(Checkpoint, PruningNeverRemovesTheCheckpointJustWritten) {
  const std::string dir = fresh_dir("prune_fresh");
  {
    Trainer t(tiny_plan(dir, {"train_steps=8", "checkpoint.resume=none", "steps_per_print=100"}), 1);
    t.run();  // leaves step_00000008.h5
  }
  Trainer t(tiny_plan(dir, {"train_steps=3", "checkpoint.interval=1", "checkpoint.keep_last=2",
                            "checkpoint.resume=none", "steps_per_print=100"}),
            1);
  t.run();
  EXPECT_EQ(latest_checkpoint(dir), dir + "/step_00000003.h5");
  EXPECT_TRUE(fs::exists(dir + "/step_00000003.h5"));
  EXPECT_TRUE(fs::exists(dir + "/step_00000002.h5"));
  EXPECT_FALSE(fs::exists(dir + "/step_00000001.h5"));
  EXPECT_TRUE(fs::exists(dir + "/step_00000008.h5"));  // a later step of another run: untouched
}

TEST(Checkpoint, AsyncWriteProducesTheSameFile) {
  const std::string dir = fresh_dir("async");
  std::string sync_path, async_path;
  {
    Trainer t(tiny_plan(dir + "/sync", {"checkpoint.resume=none"}), 1);
    t.train_step(0);
    sync_path = t.save_checkpoint(1);
  }
  {
    Trainer t(tiny_plan(dir + "/async", {"checkpoint.resume=none", "checkpoint.async=true"}), 1);
    t.train_step(0);
    async_path = t.save_checkpoint(1);
  }  // the destructor waits for the background write
  io::H5File a(sync_path, io::H5File::Mode::kRead), b(async_path, io::H5File::Mode::kRead);
  const auto names = a.list("model");
  ASSERT_EQ(names, b.list("model"));
  for (const auto& n : names) EXPECT_EQ(a.read_floats("model/" + n), b.read_floats("model/" + n)) << n;
  for (const auto& n : a.list("optimizer/exp_avg")) EXPECT_EQ(a.read_floats("optimizer/exp_avg/" + n), b.read_floats("optimizer/exp_avg/" + n));
}

// Makes a valid checkpoint of the tiny model and returns its path.
std::string make_checkpoint(const std::string& dir, const std::vector<std::string>& sets = {}) {
  std::vector<std::string> all = {"checkpoint.resume=none"};
  all.insert(all.end(), sets.begin(), sets.end());
  Trainer t(tiny_plan(dir, all), 1);
  t.train_step(0);
  return t.save_checkpoint(1);
}

void expect_load_error(const std::string& path, const std::string& fragment, std::vector<std::string> sets = {}) {
  sets.push_back("checkpoint.resume=" + path);
  try {
    Trainer t(tiny_plan(fresh_dir("load_target"), sets), 1);
    ADD_FAILURE() << "loaded " << path;
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Checkpoint, TruncatedFileIsNamed) {
  const std::string path = make_checkpoint(fresh_dir("trunc"));
  fs::resize_file(path, fs::file_size(path) / 2);
  expect_load_error(path, "truncated");
}

TEST(Checkpoint, CorruptedBytesFailTheChecksumAndNameTheTensor) {
  const std::string path = make_checkpoint(fresh_dir("corrupt"));
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(fs::file_size(path) / 2));
    const char junk[64] = {1, 2, 3, 4, 5, 6, 7, 8};
    f.write(junk, sizeof junk);
  }
  expect_load_error(path, "fails its checksum or cannot be read");
}

TEST(Checkpoint, MissingTensorShapeMismatchAndNewerFormatAreNamed) {
  // Saved without shared experts: loading into the tiny config misses their tensors.
  const std::string no_shared = make_checkpoint(fresh_dir("noshared"), {"model.n_shared_experts=0"});
  expect_load_error(no_shared, "no tensor 'model/model.layers.1.mlp.shared_experts.gate_proj.weight'");
  // Saved with a wider dense MLP.
  const std::string wide = make_checkpoint(fresh_dir("wide"), {"model.intermediate_size=96"});
  expect_load_error(wide, "has shape [96, 64] in the checkpoint but [128, 64] in this config");
  // A format version from the future.
  const std::string future = make_checkpoint(fresh_dir("future"));
  {
    io::H5File f(future, io::H5File::Mode::kReadWrite);
    f.set_attr("format_version", 3.0);
  }
  expect_load_error(future, "format version 3 is newer than this dstrain reads (2)");
  std::ofstream(::testing::TempDir() + "/ckpt_not.h5") << "plain text";
  expect_load_error(::testing::TempDir() + "/ckpt_not.h5", "cannot be opened as HDF5");
}

TEST(Checkpoint, LatestPointingAtAMissingFileIsAnError) {
  const std::string dir = fresh_dir("dangling");
  fs::create_directories(dir);
  std::ofstream(dir + "/latest") << "step_00000099.h5\n";
  try {
    latest_checkpoint(dir);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("`latest` names step_00000099.h5, which does not exist"), std::string::npos);
  }
}

}  // namespace
}  // namespace dstrain::runtime

namespace dstrain::io {
namespace {

// The direct-I/O driver writes ordinary HDF5: files it writes read back bit for bit through
// itself and through the default driver, for every kind of dataset a checkpoint holds (odd and
// empty shapes, checked chunked floats larger than its 8 MiB staging buffers, attributes), and
// it reads files the default driver wrote, slices included.
TEST(DirectDriver, FilesMatchTheDefaultDriverBothWays) {
  const std::string dir = ::testing::TempDir() + "/direct_vfd";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"model/a", {7}}, {"model/b", {3, 5}}, {"model/empty", {0, 4}}, {"model/big", {1500, 2049}},
      {"optimizer/exp_avg/x.weight", {257, 129}}, {"model/c", {1 << 20}}};
  const auto values = [](int64_t n, int salt) {
    std::vector<float> v(size_t(std::max<int64_t>(n, 0)));
    for (size_t i = 0; i < v.size(); ++i) v[i] = float((i * 2654435761u + salt) % 100003) * 1e-3f - 7.0f;
    return v;
  };
  for (const auto driver : {H5File::Driver::kDirect, H5File::Driver::kDefault}) {
    const std::string path = dir + (driver == H5File::Driver::kDirect ? "/direct.h5" : "/default.h5");
    {
      H5File f(path, H5File::Mode::kCreate, driver);
      int salt = 0;
      for (const auto& [name, shape] : shapes) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        f.write_checked(name, values(n, ++salt).data(), shape);
      }
      f.set_attr("step", 42.0);
      f.set_attr("config_yaml", std::string(20000, 'y'));
    }
    for (const auto reader : {H5File::Driver::kDirect, H5File::Driver::kDefault}) {
      H5File f(path, H5File::Mode::kRead, reader);
      int salt = 0;
      for (const auto& [name, shape] : shapes) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        EXPECT_EQ(f.shape(name), shape) << name;
        EXPECT_EQ(f.read_floats(name), values(n, ++salt)) << name;
      }
      const std::vector<float> all = values(1500 * 2049, 4);
      const std::vector<float> slice = f.read_slice("model/big", {700, 1024}, {100, 1025});
      for (int64_t r = 0; r < 100; ++r)
        for (int64_t c = 0; c < 1025; c += 256) ASSERT_EQ(slice[r * 1025 + c], all[(700 + r) * 2049 + 1024 + c]);
      EXPECT_EQ(f.attr_double("step"), 42.0);
      EXPECT_EQ(f.attr_string("config_yaml").size(), 20000u);
    }
  }
}

}  // namespace
}  // namespace dstrain::io
