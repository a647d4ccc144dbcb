// Tensor (+ sequence) parallelism end to end, through the executable under mpirun: every layout
// reproduces the single-rank run (the loss at every step, the final weights), --dump-grads
// assembles the same gradients on any layout, and checkpoints move between tensor degrees.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "engine/io/hdf5_file.h"
#include "tests/cli/cli_util.h"

namespace {

using namespace dstrain::testing;

const std::string kBatch = " --set train_batch_size=16 --set train_micro_batch_size_per_gpu=4";

// 10 steps of the tiny preset on TP 2 and 4, with and without sequence parallelism, TP x DP with
// ZeRO-1 and ZeRO-2, a vocabulary TP 4 does not divide (250 = 63 + 63 + 63 + 61 rows) and an
// MTP module: the loss at every step to 1e-5 and the final weights to 1e-4 of one rank's.
TEST(TensorParallel, EveryLayoutMatchesOneRank) {
  const std::string dir = ::testing::TempDir() + "/tp_layouts";
  std::filesystem::remove_all(dir);
  struct Ref {
    std::string name, extra;
  };
  const std::vector<Ref> refs = {{"one", ""},
                                 {"one_v250", " --set model.vocab_size=250"},
                                 {"one_mtp", " --set model.num_nextn_predict_layers=1"}};
  for (const Ref& ref : refs) ASSERT_EQ(run(train_cmd(dir, ref.name, 10, "--resume none" + kBatch + ref.extra)).rc, 0);
  struct Case {
    int np;
    std::string name, ref, extra;
  };
  const std::string sp = " --set parallel.sequence_parallel=true";
  const std::vector<Case> cases = {
      {2, "tp2", "one", " --set parallel.tensor=2"},
      {2, "tp2_sp", "one", " --set parallel.tensor=2" + sp},
      {4, "tp4", "one", " --set parallel.tensor=4"},
      {4, "tp4_sp", "one", " --set parallel.tensor=4" + sp},
      {4, "tp2_dp2_zero1", "one", " --set parallel.tensor=2 --set zero_optimization.stage=1"},
      {4, "tp2_dp2_zero2_sp", "one", " --set parallel.tensor=2 --set zero_optimization.stage=2" + sp},
      {4, "tp4_v250_sp", "one_v250", " --set parallel.tensor=4 --set model.vocab_size=250" + sp},
      {2, "tp2_mtp_sp", "one_mtp", " --set parallel.tensor=2 --set model.num_nextn_predict_layers=1" + sp},
  };
  for (const Case& c : cases) {
    const Result r = run(mpirun(c.np) + train_cmd(dir, c.name, 10, "--resume none" + kBatch + c.extra));
    ASSERT_EQ(r.rc, 0) << c.name << r.err;
    expect_same_curve(dir, c.ref, c.name, 10);
  }
}

// --dump-grads on TP 2 and on TP 2 x DP 2 with sequence parallelism writes the same file as on
// one rank: every weight exactly, every gradient to 1e-5 of the tensor's largest magnitude, the
// same losses.
TEST(TensorParallel, DumpGradsOnAnyLayoutMatchesOneRank) {
  const std::string dir = ::testing::TempDir() + "/tp_dump";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string base = kDstrain + " configs/tiny.yaml --resume none --set model.num_nextn_predict_layers=1 --dump-grads ";
  ASSERT_EQ(run(base + dir + "/one.h5").rc, 0);
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, " --set parallel.tensor=2"}, {4, " --set parallel.tensor=2 --set parallel.sequence_parallel=true"}};
  for (const auto& [np, extra] : layouts) {
    const std::string path = dir + "/np" + std::to_string(np) + ".h5";
    const Result r = run(mpirun(np) + base + path + extra);
    ASSERT_EQ(r.rc, 0) << r.err;
    expect_same_dump(dir + "/one.h5", path, extra);
  }
}

// A checkpoint of TP 2 resumes on one rank and on TP 4 with sequence parallelism, and one of a
// single rank on TP 2 x DP 2: each continues the 8-step single-rank curve.
TEST(TensorParallel, CheckpointsMoveBetweenTensorDegrees) {
  const std::string dir = ::testing::TempDir() + "/tp_ckpt";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(run(train_cmd(dir, "straight", 8, "--resume none" + kBatch)).rc, 0);
  ASSERT_EQ(run(mpirun(2) + train_cmd(dir, "tp2", 4, "--resume none --set parallel.tensor=2" + kBatch)).rc, 0);
  ASSERT_EQ(run(train_cmd(dir, "one", 4, "--resume none" + kBatch)).rc, 0);
  struct Case {
    int np;
    std::string name, from, extra;
  };
  const std::vector<Case> cases = {
      {1, "tp2_then_one", "tp2", ""},
      {4, "tp2_then_tp4_sp", "tp2", " --set parallel.tensor=4 --set parallel.sequence_parallel=true"},
      {4, "one_then_tp2_dp2", "one", " --set parallel.tensor=2 --set zero_optimization.stage=2"},
  };
  const auto ref = losses(dir + "/straight.jsonl");
  for (const Case& c : cases) {
    const Result r =
        run((c.np > 1 ? mpirun(c.np) : "") + train_cmd(dir, c.name, 8, "--resume " + dir + "/" + c.from + kBatch + c.extra));
    expect_resumed_curve(dir, c.name, r, ref, 4, 8);
  }
}

}  // namespace
