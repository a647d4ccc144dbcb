// Pipeline parallelism end to end, through the executable under mpirun: every schedule on 2 and
// 4 stages, and DP x TP x PP on 8 ranks, reproduce the single-rank run (the loss at every step,
// the final weights); --dump-grads assembles the same gradients under pipeline parallelism;
// a checkpoint of the 3D run resumes on one rank and on 4 stages; --dry-run prints the schedule.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "engine/io/hdf5_file.h"
#include "tests/cli/cli_util.h"

namespace {

using namespace dstrain::testing;

// 16 sequences per step in micro-batches of 4: 4 micro-batches on one data-parallel rank, 2 on two.
const std::string kBatch = " --set train_batch_size=16 --set train_micro_batch_size_per_gpu=4";
const std::string kFourLayers = " --set model.num_hidden_layers=4 --set model.num_nextn_predict_layers=1";

std::string schedule(const std::string& kind) { return " --set parallel.pipeline_schedule=" + kind; }

TEST(Pipeline, EveryScheduleAndLayoutMatchesOneRank) {
  const std::string dir = ::testing::TempDir() + "/pp_layouts";
  std::filesystem::remove_all(dir);
  const std::string eight = " --set model.num_hidden_layers=8 --set model.num_nextn_predict_layers=1";
  ASSERT_EQ(run(train_cmd(dir, "one", 10, "--resume none" + kBatch + kFourLayers)).rc, 0);
  ASSERT_EQ(run(train_cmd(dir, "one8", 10, "--resume none" + kBatch + eight)).rc, 0);
  struct Case {
    int np;
    std::string name, ref, extra;
  };
  const std::string pp2 = kFourLayers + " --set parallel.pipeline=2", pp4 = kFourLayers + " --set parallel.pipeline=4";
  const std::string interleaved = schedule("interleaved") + " --set parallel.virtual_stages=2";
  const std::vector<Case> cases = {
      {2, "pp2_gpipe", "one", pp2 + schedule("gpipe")},
      {2, "pp2_1f1b", "one", pp2 + schedule("1f1b")},
      {2, "pp2_interleaved", "one", pp2 + interleaved},
      {2, "pp2_zbh1", "one", pp2 + schedule("zb-h1")},
      {4, "pp4_gpipe", "one", pp4 + schedule("gpipe")},
      {4, "pp4_1f1b", "one", pp4 + schedule("1f1b")},
      {4, "pp4_interleaved", "one8", eight + " --set parallel.pipeline=4" + interleaved},
      {4, "pp4_zbh1", "one", pp4 + schedule("zb-h1")},
      {4, "pp2_dp2_zero2_zbh1", "one", pp2 + schedule("zb-h1") + " --set zero_optimization.stage=2"},
      {4, "pp2_tp2_sp_zbh1", "one", pp2 + schedule("zb-h1") + " --set parallel.tensor=2 --set parallel.sequence_parallel=true"},
      {8, "dp2_tp2_pp2_zero1_sp", "one",
       pp2 + " --set parallel.tensor=2 --set parallel.sequence_parallel=true --set zero_optimization.stage=1"},
  };
  for (const Case& c : cases) {
    const Result r = run(mpirun(c.np) + train_cmd(dir, c.name, 10, "--resume none" + kBatch + c.extra));
    ASSERT_EQ(r.rc, 0) << c.name << r.err;
    expect_same_curve(dir, c.ref, c.name, 10);
    // Activations live in model instances reused by liveness: as many as the schedule holds at once.
    if (c.name == "pp2_gpipe") {
      EXPECT_NE(r.out.find(" in 4 model instances (the schedule"), std::string::npos) << r.out;
    }
    if (c.name == "pp2_1f1b" || c.name == "pp2_zbh1") {
      EXPECT_NE(r.out.find(" in 2 model instances (the schedule"), std::string::npos) << r.out;
    }
  }
}

// --dump-grads under 2 stages (the MTP module on the last, its embedding a mirror of the
// first's), with each kind of backward (whole, B / W split), and times TP 2 with sequence
// parallelism: the file one rank writes — the weights exactly, every gradient to 1e-5 of the
// tensor's largest magnitude, the same losses.
TEST(Pipeline, DumpGradsMatchesOneRank) {
  const std::string dir = ::testing::TempDir() + "/pp_dump";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string base = kDstrain + " configs/tiny.yaml --resume none --set model.num_nextn_predict_layers=1 --dump-grads ";
  ASSERT_EQ(run(base + dir + "/one.h5").rc, 0);
  const std::vector<std::pair<int, std::string>> layouts = {
      {2, " --set parallel.pipeline=2"},
      {2, " --set parallel.pipeline=2" + schedule("zb-h1")},
      {4, " --set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.sequence_parallel=true"}};
  int n = 0;
  for (const auto& [np, extra] : layouts) {
    const std::string path = dir + "/layout" + std::to_string(n++) + ".h5";
    const Result r = run(mpirun(np) + base + path + extra);
    ASSERT_EQ(r.rc, 0) << r.err;
    expect_same_dump(dir + "/one.h5", path, extra);
    dstrain::io::H5File a(dir + "/one.h5", dstrain::io::H5File::Mode::kRead);
    EXPECT_GT(a.attr_double("mtp_loss"), 0.0);
  }
}

// A checkpoint of DP 2 x TP 2 x PP 2 (ZeRO-2) after 4 steps resumes on one rank and on 4
// pipeline stages (zero-bubble): both continue the 8-step single-rank curve.
TEST(Pipeline, CheckpointOfThe3dRunResumesOnOtherLayouts) {
  const std::string dir = ::testing::TempDir() + "/pp_ckpt";
  std::filesystem::remove_all(dir);
  ASSERT_EQ(run(train_cmd(dir, "straight", 8, "--resume none" + kBatch + kFourLayers)).rc, 0);
  const Result three = run(mpirun(8) + train_cmd(dir, "3d", 4,
                                                 "--resume none" + kBatch + kFourLayers +
                                                     " --set parallel.pipeline=2 --set parallel.tensor=2 "
                                                     "--set zero_optimization.stage=2"));
  ASSERT_EQ(three.rc, 0) << three.err;
  struct Case {
    int np;
    std::string name, extra;
  };
  const std::vector<Case> cases = {{1, "3d_then_one", ""},
                                   {4, "3d_then_pp4", " --set parallel.pipeline=4" + schedule("zb-h1")}};
  const auto ref = losses(dir + "/straight.jsonl");
  for (const Case& c : cases) {
    const Result r = run((c.np > 1 ? mpirun(c.np) : "") +
                         train_cmd(dir, c.name, 8, "--resume " + dir + "/3d" + kBatch + kFourLayers + c.extra));
    expect_resumed_curve(dir, c.name, r, ref, 4, 8);
  }
}

// --dry-run shows each rank's instruction list, the bubble the simulator predicts and the
// activations held by the micro-batches in flight.
TEST(Pipeline, DryRunPrintsTheSchedulePerStage) {
  const Result r = run(kDstrain + " configs/tiny.yaml --dry-run --world-size 2 --set parallel.pipeline=2" + kBatch +
                       schedule("zb-h1"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("pipeline   zb-h1: 2 stages x 1 chunk, 4 micro-batches per step; bubble 7.7% of the step"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("  rank 0: F0 F1 BI0 W0 F2 BI1 W1 F3 BI2 W2 BI3 W3\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  rank 1: F0 BI0 F1 BI1 W0 F2 BI2 W1 F3 BI3 W2 W3\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("up to 2 micro-batches in flight: activations"), std::string::npos) << r.out;
  const Result g = run(kDstrain + " configs/tiny.yaml --dry-run --world-size 2 --set parallel.pipeline=2" + kBatch +
                       schedule("gpipe"));
  ASSERT_EQ(g.rc, 0) << g.err;
  EXPECT_NE(g.out.find("bubble 20.0% of the step"), std::string::npos) << g.out;  // (p-1)/(m+p-1) = 1/5
  EXPECT_NE(g.out.find("up to 4 micro-batches in flight"), std::string::npos) << g.out;
}

// The shipped 3D preset plans 8 ranks as DP 2 x TP 2 x PP 2.
TEST(Pipeline, ShippedThreeDimensionalPresetPlansEightRanks) {
  const Result r = run(kDstrain + " configs/small-3d.yaml --dry-run --world-size 8");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("world 8 = tensor 2 x pipeline 2 x data 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("pipeline   1f1b: 2 stages"), std::string::npos) << r.out;
}

}  // namespace
