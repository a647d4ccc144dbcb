// Activation checkpointing (docs/design.md §6.7): recomputation changes where activations live,
// never a bit of the result. Gradients (--dump-grads) and whole training curves with full and
// selective recomputation are bitwise those of the run that keeps everything, on one rank and
// under pipeline (1F1B, ZB-H1), tensor + sequence and expert parallelism; the activation memory
// measured after the first step is the plan's; --dry-run shows what recomputation saves.
#include <filesystem>
#include <regex>
#include <tuple>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

const std::string kFull = " --set activation_checkpointing.enabled=true --set activation_checkpointing.granularity=full";
const std::string kSelective =
    " --set activation_checkpointing.enabled=true --set activation_checkpointing.granularity=selective";

// Two --dump-grads files are bitwise equal: losses, weights and every gradient element.
void expect_identical_dump(const std::string& want_path, const std::string& got_path, const std::string& what) {
  io::H5File a(want_path, io::H5File::Mode::kRead), b(got_path, io::H5File::Mode::kRead);
  for (const char* loss : {"ce_loss", "aux_loss", "mtp_loss"}) EXPECT_EQ(b.attr_double(loss), a.attr_double(loss)) << loss << what;
  ASSERT_EQ(b.list("grads"), a.list("grads")) << what;
  for (const std::string& name : a.list("grads")) {
    const auto x = a.read_floats("grads/" + name), y = b.read_floats("grads/" + name);
    ASSERT_EQ(x.size(), y.size()) << name << what;
    size_t differ = 0;
    for (size_t i = 0; i < x.size(); ++i) differ += x[i] != y[i];
    EXPECT_EQ(differ, 0u) << name << what;
  }
}

TEST(Recompute, GradientsAreBitwiseEqualInEveryLayout) {
  const std::string dir = fresh_dir("recompute_dump");
  // Four layers, so that every stage of PP 2 has a layer that recomputes (the last recomputing
  // layer of a forward still holds its values and skips it).
  const std::string base = kDstrain +
                           " configs/tiny.yaml --resume none --set model.num_nextn_predict_layers=1 "
                           "--set model.num_hidden_layers=4 --dump-grads ";
  // 16-bit runs with 16-bit GEMM operands (DSTRAIN_LOWP_GEMM=native: on 16-bit operands even on
  // a CPU without a native matmul for the type) — saved 16-bit activations, the deferred W GEMMs'
  // typed copies.
  const std::string lp16 = "DSTRAIN_LOWP_GEMM=native ";
  const std::vector<std::tuple<int, std::string, std::string>> layouts = {
      {1, "", ""},
      {2, " --set parallel.pipeline=2", ""},
      {2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=zb-h1", ""},
      {2, " --set parallel.tensor=2 --set parallel.sequence_parallel=true", ""},
      {2, " --set parallel.expert=2", ""},
      {1, " --set bf16.enabled=true", lp16},
      {2, " --set fp16.enabled=true --set parallel.pipeline=2 --set parallel.pipeline_schedule=zb-h1", lp16}};
  int n = 0;
  for (const auto& [np, layout_args, env] : layouts) {
    const std::string layout = layout_args;
    const std::string launch = env + (np > 1 ? mpirun(np) : "");
    const std::string keep = dir + "/keep" + std::to_string(n) + ".h5";
    Result r = run(launch + base + keep + layout);
    ASSERT_EQ(r.rc, 0) << layout << r.err;
    for (const std::string& mode : {kFull, kSelective, kFull + " --set activation_checkpointing.num_layers=2"}) {
      const std::string path = dir + "/recompute" + std::to_string(n) + ".h5";
      r = run(launch + base + path + layout + mode);
      ASSERT_EQ(r.rc, 0) << layout << mode << r.err;
      expect_identical_dump(keep, path, layout + mode);
    }
    ++n;
  }
}

// Whole runs: every step's loss and the final weights bitwise equal, with several micro-batches
// per step (recomputed one by one, in flight together under the pipeline schedules).
TEST(Recompute, TrainingCurvesAreBitwiseEqual) {
  const std::string dir = fresh_dir("recompute_curve");
  const int steps = 6;
  const std::string batch =
      " --set train_batch_size=8 --set train_micro_batch_size_per_gpu=2 --set model.num_hidden_layers=4";
  const std::vector<std::pair<int, std::string>> layouts = {
      {1, ""}, {2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=zb-h1"}};
  int n = 0;
  for (const auto& [np, layout] : layouts) {
    const std::string launch = np > 1 ? mpirun(np) : "";
    const std::string keep = "keep" + std::to_string(n);
    ASSERT_EQ(run(launch + train_cmd(dir, keep, steps, "--resume none" + batch + layout)).rc, 0) << layout;
    int m = 0;
    for (const std::string& mode : {kFull, kSelective}) {
      const std::string name = "recompute" + std::to_string(n) + "_" + std::to_string(m++);
      const Result r = run(launch + train_cmd(dir, name, steps, "--resume none" + batch + layout + mode));
      ASSERT_EQ(r.rc, 0) << layout << mode << r.err;
      const auto want = losses(dir + "/" + keep + ".jsonl"), got = losses(dir + "/" + name + ".jsonl");
      ASSERT_EQ(got.size(), size_t(steps)) << name;
      for (const auto& [step, loss] : want) EXPECT_EQ(got.at(step), loss) << layout << mode << " step " << step;
      char last[32];
      std::snprintf(last, sizeof last, "/step_%08d.h5", steps);
      EXPECT_EQ(max_weight_difference(dir + "/" + keep + last, dir + "/" + name + last), 0.0) << layout << mode;
    }
    ++n;
  }
}

// The activation memory the first step allocated on rank 0 (all model instances the schedule
// holds at once, each chunk's pool at its own peak, one recompute arena for all) is within 10%
// of the plan's figure, in every layout and recomputation mode.
TEST(Recompute, MeasuredActivationMemoryMatchesThePlan) {
  const std::string dir = fresh_dir("recompute_memory");
  const std::string batch = " --set train_batch_size=8 --set train_micro_batch_size_per_gpu=2";
  struct Layout {
    int np;
    std::string args, env = "";
  };
  const std::vector<Layout> layouts = {
      {1, ""},
      {1, kFull},
      {1, kSelective + " --set model.num_nextn_predict_layers=1"},
      {2, " --set parallel.pipeline=2" + kFull},
      {2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=gpipe" + kSelective},
      {2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=interleaved --set parallel.virtual_stages=2 "
          "--set model.num_hidden_layers=4" + kFull},
      {2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=zb-h1" + kFull},
      {2, " --set parallel.tensor=2 --set parallel.sequence_parallel=true" + kSelective},
      {2, " --set parallel.expert=2"},
      // bf16 adds the GEMMs' conversion workspaces to the plan and to what the model holds.
      {1, " --set bf16.enabled=true"},
      {2, " --set bf16.enabled=true --set parallel.tensor=2 --set parallel.sequence_parallel=true" + kFull},
      {2, " --set fp16.enabled=true --set parallel.pipeline=2"},
      // The LM head in chunks of 100 rows (its reductions per chunk under tensor parallelism).
      {1, " --set bf16.enabled=true", "DSTRAIN_LOSS_CHUNK_TOKENS=100 "},
      {2, " --set parallel.tensor=2 --set parallel.sequence_parallel=true --set model.num_nextn_predict_layers=1",
       "DSTRAIN_LOSS_CHUNK_TOKENS=100 "},
      {2, " --set bf16.enabled=true --set parallel.pipeline=2", "DSTRAIN_LOSS_CHUNK_TOKENS=100 "},
      // 16-bit GEMM operands where the attention may still widen Q, K, V (no 16-bit matmul for
      // the type on this CPU): the plan counts each side as the backend runs it.
      {1, " --set bf16.enabled=true" + kSelective, "DSTRAIN_LOWP_GEMM=native "},
      {2, " --set fp16.enabled=true --set parallel.tensor=2 --set parallel.sequence_parallel=true" + kFull,
       "DSTRAIN_LOWP_GEMM=native "}};
  const std::regex line(R"(activation memory on rank 0 after the first step: .* \(plan .*, ([-+][0-9.]+)%\))");
  for (const auto& [np, args, env] : layouts) {
    const std::string layout = env + args;
    const Result r = run(env + (np > 1 ? mpirun(np) : "") + train_cmd(dir, "run", 1, "--resume none" + batch + args));
    ASSERT_EQ(r.rc, 0) << layout << r.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.out, m, line)) << layout << r.out;
    EXPECT_LE(std::fabs(std::stod(m[1].str())), 10.0) << layout << m[0].str();
    // Only the zero-bubble schedule queues copies, and says how much they held.
    EXPECT_EQ(r.out.find("the zero-bubble W queues held up to") != std::string::npos,
              layout.find("zb-h1") != std::string::npos)
        << layout << m[0].str();
  }
}

// --dry-run prints the activations each stage keeps under the chosen recomputation, smaller
// with selective and smaller still with full; a recomputed-layer count beyond the model is refused.
TEST(Recompute, DryRunShowsWhatRecomputationSaves) {
  const std::regex saved(R"(stage 0 +saved ([0-9.]+) (KiB|MiB|GiB))");
  const auto saved_mib = [&](const std::string& extra) {
    const Result r = run(kDstrain + " configs/small.yaml --dry-run" + extra);
    EXPECT_EQ(r.rc, 0) << r.err;
    std::smatch m;
    if (!std::regex_search(r.out, m, saved)) {
      ADD_FAILURE() << "no activation line in:\n" << r.out;
      return 0.0;
    }
    const double scale = m[2] == "KiB" ? 1.0 / 1024 : m[2] == "GiB" ? 1024.0 : 1.0;
    return std::stod(m[1].str()) * scale;
  };
  const double keep = saved_mib(""), selective = saved_mib(kSelective), full = saved_mib(kFull);
  EXPECT_LT(selective, keep);
  EXPECT_LT(full, selective);
  EXPECT_LT(3 * full, keep) << "full recomputation of small keeps a third or less";
  const Result r = run(kDstrain + " configs/tiny.yaml --dry-run" + kFull + " --set activation_checkpointing.num_layers=9");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("activation_checkpointing.num_layers: 9 recomputed layers per stage but the model has only 2"),
            std::string::npos)
      << r.err;
}

// train_micro_batch_size_per_gpu: auto on the command line: a run takes the largest micro-batch
// its budget holds (here the whole per-rank batch), logs the choice and trains; a budget nothing
// fits stops before training with the smallest need.
TEST(MicroBatchAuto, ChoosesFitsAndTrains) {
  const std::string dir = fresh_dir("micro_auto");
  Result r = run(mpirun(2) + train_cmd(dir, "auto", 2,
                                       "--resume none --set train_batch_size=8 --set train_micro_batch_size_per_gpu=auto "
                                       "--set memory_budget_gib=4"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("train_micro_batch_size_per_gpu auto: 4 (x 1 accumulation x 2 data-parallel)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(losses(dir + "/auto.jsonl").size(), 2u);
  r = run(kDstrain + " configs/tiny.yaml --set train_micro_batch_size_per_gpu=auto --set memory_budget_gib=0.0001");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("auto, but even a micro-batch of 1 needs"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace dstrain::testing
