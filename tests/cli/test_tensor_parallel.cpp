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
    const auto want = losses(dir + "/" + c.ref + ".jsonl"), got = losses(dir + "/" + c.name + ".jsonl");
    ASSERT_EQ(want.size(), 10u) << c.ref;
    ASSERT_EQ(got.size(), 10u) << c.name;
    for (const auto& [step, loss] : want) EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << c.name << " step " << step;
    EXPECT_LT(max_weight_difference(dir + "/" + c.ref + "/step_00000010.h5", dir + "/" + c.name + "/step_00000010.h5"),
              1e-4)
        << c.name;
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
    dstrain::io::H5File a(dir + "/one.h5", dstrain::io::H5File::Mode::kRead);
    dstrain::io::H5File b(path, dstrain::io::H5File::Mode::kRead);
    for (const char* loss : {"ce_loss", "aux_loss", "mtp_loss"})
      EXPECT_NEAR(b.attr_double(loss), a.attr_double(loss), 1e-6 * a.attr_double(loss)) << loss << extra;
    EXPECT_EQ(b.read_ints("tokens"), a.read_ints("tokens"));
    ASSERT_EQ(b.list("weights"), a.list("weights"));
    ASSERT_EQ(b.list("grads"), a.list("grads"));
    for (const std::string& name : a.list("weights")) EXPECT_EQ(b.read_floats("weights/" + name), a.read_floats("weights/" + name)) << name;
    for (const std::string& name : a.list("grads")) {
      const auto x = a.read_floats("grads/" + name), y = b.read_floats("grads/" + name);
      double scale = 1e-30, d = 0;
      for (size_t i = 0; i < x.size(); ++i) scale = std::max(scale, double(std::fabs(x[i])));
      for (size_t i = 0; i < x.size(); ++i) d = std::max(d, double(std::fabs(x[i] - y[i])));
      EXPECT_LE(d / scale, 1e-5) << name << extra;
    }
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
    ASSERT_EQ(r.rc, 0) << c.name << r.err;
    EXPECT_NE(r.out.find("at step 4"), std::string::npos) << r.out;
    const auto got = losses(dir + "/" + c.name + ".jsonl");
    for (int step = 5; step <= 8; ++step) EXPECT_NEAR(got.at(step), ref.at(step), 1e-5 * ref.at(step)) << c.name << " step " << step;
  }
}

}  // namespace
