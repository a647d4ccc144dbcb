// bf16 / fp16 mixed precision (docs/design.md §6.10) through the binary: the small preset
// trained 300 steps in each precision reaches fp32's validation loss; the parallel layouts
// reproduce the single-rank mixed-precision run; an overflowing gradient skips exactly one fp16
// step and is logged, and an overflow at the minimum loss scale stops the run; resuming a
// ZeRO-sharded mixed-precision run is bit-exact (the master weights are what is saved); the
// native and the widened 16-bit GEMM paths train alike.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <regex>
#include <tuple>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

// Values of one metric by step.
std::map<int, double> metric(const std::string& path, const std::string& key) {
  std::map<int, double> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    if (row.contains("step") && row.contains(key)) out[row["step"].get<int>()] = row[key].get<double>();
  }
  return out;
}

const std::string kBf16 = " --set bf16.enabled=true";
const std::string kFp16 = " --set fp16.enabled=true";

// The issue's criterion: 300 steps of `small` (here 2 sequences of 64 tokens per step, so that
// the three runs take about 80 s on 2 cores) reach a validation loss within 0.05 nats per byte
// of fp32's (measured 2026-12-06: fp32 2.2902, bf16 2.2955, fp16 2.2920).
TEST(MixedPrecision, SmallReachesTheValidationLossOfFp32) {
  const std::string dir = fresh_dir("mp_small");
  const std::string base = kDstrain +
                           " configs/small.yaml --resume none --set train_steps=300 --set train_batch_size=2 "
                           "--set seq_length=64 --set steps_per_print=100 --set data.eval_interval=300 "
                           "--set checkpoint.interval=0 "
                           "--set monitor.expert_stats_interval=0 --set checkpoint.dir=" + dir;
  std::map<std::string, double> val;
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::string>>{{"fp32", ""}, {"bf16", kBf16}, {"fp16", kFp16}}) {
    const Result r = run(base + "/" + name + " --set monitor.metrics_file=" + dir + "/" + name + ".jsonl" + extra);
    ASSERT_EQ(r.rc, 0) << name << r.err;
    const auto v = metric(dir + "/" + name + ".jsonl", "val_loss");
    ASSERT_EQ(v.count(300), 1u) << name;
    val[name] = v.at(300);
  }
  std::cout << "validation loss after 300 steps: fp32 " << val["fp32"] << ", bf16 " << val["bf16"] << ", fp16 "
            << val["fp16"] << "\n";
  EXPECT_LT(val["fp32"], 3.0);  // it learned something: byte-level text starts at ln(256) = 5.5
  EXPECT_NEAR(val["bf16"], val["fp32"], 0.05);
  EXPECT_NEAR(val["fp16"], val["fp32"], 0.05);
  // The runs differ at all: the GEMMs really ran in low precision.
  EXPECT_NE(val["bf16"], val["fp32"]);
  EXPECT_NE(val["fp16"], val["fp32"]);
}

// Every layout trains the same mixed-precision curve as one rank, to the precision's tolerance
// (summation orders differ by layout, and a different fp32 sum can round to another bf16 value).
TEST(MixedPrecision, LayoutsReproduceTheSingleRankRun) {
  const std::string dir = fresh_dir("mp_layouts");
  const std::string batch = "--resume none --set train_batch_size=8 --set train_micro_batch_size_per_gpu=2";
  // bf16 and fp16 as the backend measured them, and fp16 again on 16-bit GEMM operands
  // (DSTRAIN_LOWP_GEMM=native: fp16 has no native matmul on the CPUs seen so far, so without it
  // no layout would run the model's 16-bit-operand paths in fp16).
  const std::vector<std::tuple<std::string, std::string, std::string>> runs = {
      {"bf16", kBf16, ""}, {"fp16", kFp16, ""}, {"fp16_operands", kFp16, "DSTRAIN_LOWP_GEMM=native "}};
  for (const auto& [tag, precision, env] : runs) {
    ASSERT_EQ(run(env + train_cmd(dir, tag + "_one", 6, batch + precision)).rc, 0);
    const auto ref = losses(dir + "/" + tag + "_one.jsonl");
    ASSERT_EQ(ref.size(), 6u);
    const std::vector<std::pair<std::string, std::string>> layouts = {
        {"dp2_zero1", " --set zero_optimization.stage=1"},
        {"dp2_zero2", " --set zero_optimization.stage=2"},
        {"tp2", " --set parallel.tensor=2 --set parallel.sequence_parallel=true"},
        {"pp2", " --set parallel.pipeline=2"},
        {"ep2", " --set parallel.expert=2"}};
    for (const auto& [name, layout] : layouts) {
      const std::string run_name = tag + "_" + name;
      const Result r = run(env + mpirun(2) + train_cmd(dir, run_name, 6, batch + precision + layout));
      ASSERT_EQ(r.rc, 0) << run_name << r.err;
      const auto got = losses(dir + "/" + run_name + ".jsonl");
      ASSERT_EQ(got.size(), 6u) << run_name;
      for (const auto& [step, loss] : ref) EXPECT_NEAR(got.at(step), loss, 2e-3 * loss) << run_name << " step " << step;
    }
  }
}

// The two ways the CPU backend runs a 16-bit GEMM (docs/design.md §6.10) — oneDNN's native
// matmul, or the 16-bit operands widened to fp32 inside the GEMM for sgemm (also where native is
// forced on a CPU without the matmul) — train alike (the same products, summed in another
// order), each stating its path, and the plan's activation figure follows each (the widened
// Q, K, V where the attention is not 16-bit). Both
// types on every CPU: the model's 16-bit-operand paths run here even where oneDNN has no matmul
// for the type (fp16 on every CPU seen so far, bf16 on AVX2-only ones).
TEST(MixedPrecision, NativeAndWidenedGemmsTrainAlike) {
  const std::string dir = fresh_dir("mp_paths");
  for (const std::string type : {"bf16", "fp16"}) {
    const std::string batch = "--resume none --set train_batch_size=8 --set train_micro_batch_size_per_gpu=2 --set " +
                              type + ".enabled=true";
    std::map<std::string, std::map<int, double>> curve;
    for (const std::string path : {"native", "widened"}) {
      const std::string name = type + "_" + path;
      const Result r = run("DSTRAIN_LOWP_GEMM=" + path + " " + train_cmd(dir, name, 6, batch));
      ASSERT_EQ(r.rc, 0) << name << r.err;
      const std::string log = r.out + r.err;
      const bool widened = log.find("GEMMs " + type + " widened to fp32") != std::string::npos;
      EXPECT_EQ(widened, path == "widened") << name << ": " << log;
      std::smatch m;
      ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(\(plan [0-9.]+ [KMG]iB, ([+-][0-9.]+)%\))"))) << log;
      EXPECT_LE(std::fabs(std::stod(m[1].str())), 10.0) << name << ": " << m[0];
      curve[path] = losses(dir + "/" + name + ".jsonl");
      ASSERT_EQ(curve[path].size(), 6u) << name;
    }
    for (const auto& [step, loss] : curve["native"])
      EXPECT_NEAR(curve["widened"].at(step), loss, 2e-3 * loss) << type << " step " << step;
  }
}

// The kernel choices are config keys (kernels:); their environment variables override the file,
// are logged, and lose to --set; a bad value, from either, is refused naming where it came from.
TEST(MixedPrecision, KernelChoicesAreConfigKeysTheEnvironmentOverrides) {
  const std::string dir = fresh_dir("mp_kernels");
  const std::string base = "--resume none --set checkpoint.save_at_end=false" + kBf16;
  Result r = run(train_cmd(dir, "key", 1, base + " --set kernels.lowp_gemm=widened"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE((r.out + r.err).find("GEMMs bf16 widened to fp32"), std::string::npos) << r.out;
  r = run("DSTRAIN_LOWP_GEMM=widened " + train_cmd(dir, "env", 1, base));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("DSTRAIN_LOWP_GEMM=widened sets kernels.lowp_gemm"), std::string::npos) << r.out;
  EXPECT_NE((r.out + r.err).find("GEMMs bf16 widened to fp32"), std::string::npos) << r.out;
  r = run("DSTRAIN_LOWP_GEMM=widened " + train_cmd(dir, "set", 1, base + " --set kernels.lowp_gemm=native"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ((r.out + r.err).find("GEMMs bf16 widened to fp32"), std::string::npos) << "--set lost to the environment";
  r = run("DSTRAIN_LOWP_GEMM=fastest " + train_cmd(dir, "bad", 1, base));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("the environment's DSTRAIN_LOWP_GEMM=fastest: kernels.lowp_gemm: invalid value fastest: valid: "
                       "one of auto, native, widened"),
            std::string::npos)
      << r.err;
  r = run(train_cmd(dir, "badkey", 1, base + " --set kernels.cuda_attention=flash"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("--set kernels.cuda_attention=flash: kernels.cuda_attention: invalid value flash"),
            std::string::npos)
      << r.err;
}

// communication_data_type rounds the reduced gradients: the curve moves, but only a little.
TEST(MixedPrecision, CommunicationDataTypeRoundsTheReduction) {
  const std::string dir = fresh_dir("mp_comm");
  const std::string batch = "--resume none --set train_batch_size=8 --set train_micro_batch_size_per_gpu=2" + kBf16;
  ASSERT_EQ(run(mpirun(2) + train_cmd(dir, "fp32_comm", 6, batch)).rc, 0);
  const Result r = run(mpirun(2) + train_cmd(dir, "bf16_comm", 6, batch + " --set communication_data_type=bf16"));
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto a = losses(dir + "/fp32_comm.jsonl"), b = losses(dir + "/bf16_comm.jsonl");
  ASSERT_EQ(b.size(), 6u);
  bool differ = false;
  for (const auto& [step, loss] : a) {
    EXPECT_NEAR(b.at(step), loss, 5e-3 * loss) << step;
    differ = differ || b.at(step) != loss;
  }
  EXPECT_TRUE(differ) << "bf16 reduction left every loss bitwise unchanged";
  EXPECT_EQ(run(kDstrain + " configs/tiny.yaml --dry-run --set communication_data_type=int8").rc, 1);
}

// DeepSpeed's fp16 rules in a real run: an inf in one gradient skips that step — weights,
// optimizer, schedule untouched — logs it, and counts it in the step line and the metrics.
TEST(MixedPrecision, InjectedInfSkipsExactlyOneFp16Step) {
  const std::string dir = fresh_dir("mp_inf");
  const std::string fault = "DSTRAIN_FAULT_INJECT=inf_grad:3 ";
  Result r = run(fault + train_cmd(dir, "fp16", 6, "--resume none" + kFp16));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string log = r.out + r.err;
  EXPECT_EQ(count(log, "skipped"), 6 + 1) << log;  // every step line, and the one warning
  EXPECT_EQ(count(log, "step 3: fp16 gradients overflowed"), 1) << log;
  const auto skipped = metric(dir + "/fp16.jsonl", "skipped_steps"), scale = metric(dir + "/fp16.jsonl", "loss_scale");
  ASSERT_EQ(skipped.size(), 6u);
  for (int s = 1; s <= 6; ++s) EXPECT_EQ(skipped.at(s), s >= 3 ? 1.0 : 0.0) << s;
  for (int s = 1; s <= 6; ++s) EXPECT_EQ(scale.at(s), 65536.0) << s;  // hysteresis 2: one overflow keeps the scale
  // The skipped step changed nothing: step 4 trains on the weights of step 2, so a run whose
  // step 3 is skipped equals, from there on, a run with one step fewer on shifted data — check
  // the weaker, exact facts: the learning rate of step 4 is that of step 3 in a clean run.
  ASSERT_EQ(run(train_cmd(dir, "clean", 4, "--resume none" + kFp16)).rc, 0);
  const auto lr_skip = metric(dir + "/fp16.jsonl", "lr"), lr_clean = metric(dir + "/clean.jsonl", "lr");
  EXPECT_EQ(lr_skip.at(4), lr_clean.at(3));
  EXPECT_EQ(lr_skip.at(2), lr_clean.at(2));
  // The same overflow in bf16 (no loss scaler, as DeepSpeed) stops the run as diverged.
  r = run(fault + train_cmd(dir, "bf16", 6, "--resume none" + kBf16));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("training diverged"), std::string::npos) << r.err;
  // At the minimum scale another overflow stops the run with a message instead of training on.
  r = run(fault + train_cmd(dir, "min", 6,
                            "--resume none" + kFp16 +
                                " --set fp16.initial_scale_power=0 --set fp16.min_loss_scale=1 --set fp16.hysteresis=1"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("min_loss_scale"), std::string::npos) << r.err;
}

// Resuming a ZeRO-1 mixed-precision run on two ranks continues it bit for bit: the checkpoint
// holds the fp32 master weights (gathered from the shards) and the loss scaler's state.
TEST(MixedPrecision, ShardedResumeIsBitExact) {
  const std::string dir = fresh_dir("mp_resume");
  for (const std::string& precision : {kBf16, kFp16}) {
    const std::string tag = precision == kBf16 ? "bf16" : "fp16";
    const std::string extra = "--set zero_optimization.stage=1 --set train_batch_size=8" + precision;
    ASSERT_EQ(run(mpirun(2) + train_cmd(dir, tag + "_straight", 8, "--resume none " + extra)).rc, 0);
    ASSERT_EQ(run(mpirun(2) + train_cmd(dir, tag + "_first", 4, "--resume none " + extra)).rc, 0);
    const Result r = run(mpirun(2) + train_cmd(dir, tag + "_second", 8,
                                               "--resume " + dir + "/" + tag + "_first/step_00000004.h5 " + extra));
    ASSERT_EQ(r.rc, 0) << r.err;
    const auto want = losses(dir + "/" + tag + "_straight.jsonl"), got = losses(dir + "/" + tag + "_second.jsonl");
    for (int s = 5; s <= 8; ++s) EXPECT_EQ(got.at(s), want.at(s)) << tag << " step " << s;
    EXPECT_EQ(max_weight_difference(dir + "/" + tag + "_straight/step_00000008.h5",
                                    dir + "/" + tag + "_second/step_00000008.h5"),
              0.0)
        << tag;
    // The saved weights are the fp32 master weights, not their 16-bit rounding.
    io::H5File f(dir + "/" + tag + "_straight/step_00000008.h5", io::H5File::Mode::kRead);
    const auto w = f.read_floats("model/model.layers.0.self_attn.o_proj.weight");
    size_t not_16bit = 0;
    for (float x : w) {
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      not_16bit += (bits & 0x1fff) != 0;  // neither a bf16 nor an fp16 value has these bits set
    }
    EXPECT_GT(not_16bit, w.size() / 2) << tag;
  }
}

}  // namespace
}  // namespace dstrain::testing
