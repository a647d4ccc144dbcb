// The engine on device memory, without a GPU (docs/design.md §6.11): with
// DSTRAIN_DEVICE_MEMORY_CHECK=1 the CPU backend hands out pointers the host cannot dereference
// (a host access faults) and refuses host pointers in its ops, so a run that completes touched
// the parameters, gradients, optimizer state, activations and routing only through the
// backend — what the CUDA backend needs. Every feature that runs on one rank must give the same
// bits as the plain CPU run: fp32, bf16, fp16, MTP, full and selective recomputation, ZeRO-2,
// DeepSeek-V2 routing, --dump-grads (and dstrain-ckpt compare-dumps on those files), and a
// checkpoint save and bit-exact resume. Every parallel layout too, its device buffers moving
// between ranks through the routing communicator (over MPI at the buffers' host addresses,
// where a GPU run uses NCCL): the same gradients as one rank, and a 3D run's training, ZeRO-2
// checkpoint and resume bit for bit those of the plain CPU run. Plus the `device` key: cpu
// always works, cuda without a usable GPU is refused with the reason.
#include <filesystem>

#include "tests/cli/cli_util.h"

namespace dstrain::testing {
namespace {

const std::string kCheck = "DSTRAIN_DEVICE_MEMORY_CHECK=1 ";

// Every step's loss and the final weights bit for bit.
void expect_identical(const std::string& dir, const std::string& a, const std::string& b, int steps) {
  const auto x = losses(dir + "/" + a + ".jsonl"), y = losses(dir + "/" + b + ".jsonl");
  ASSERT_EQ(x.size(), size_t(steps)) << a;
  EXPECT_EQ(x, y) << a << " vs " << b;
  char last[32];
  std::snprintf(last, sizeof last, "/step_%08d.h5", steps);
  EXPECT_EQ(max_weight_difference(dir + "/" + a + last, dir + "/" + b + last), 0.0) << a << " vs " << b;
}

TEST(DeviceMemory, EveryOneRankFeatureTrainsBitwiseTheSameBehindDeviceMemory) {
  const std::string dir = fresh_dir("devmem");
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"fp32", ""},
      {"bf16_full", " --set bf16.enabled=true --set activation_checkpointing.enabled=true"},
      {"fp16_selective",
       " --set fp16.enabled=true --set activation_checkpointing.enabled=true"
       " --set activation_checkpointing.granularity=selective"},
      {"mtp_zero2", " --set model.num_nextn_predict_layers=1 --set zero_optimization.stage=2 --set gradient_clipping=0.5"},
      {"v2", " --set model.model_type=deepseek_v2 --set model.topk_method=greedy --set model.scoring_func=softmax"},
  };
  for (const auto& [name, extra] : variants) {
    const Result cpu = run(train_cmd(dir, name + "_cpu", 4, "--resume none" + extra));
    ASSERT_EQ(cpu.rc, 0) << name << cpu.err;
    const Result dev = run(kCheck + train_cmd(dir, name + "_dev", 4, "--resume none" + extra));
    ASSERT_EQ(dev.rc, 0) << name << dev.err;
    EXPECT_NE((dev.out + dev.err).find("behind checked device memory"), std::string::npos) << dev.out;
    expect_identical(dir, name + "_cpu", name + "_dev", 4);
  }
}

TEST(DeviceMemory, ResumeAndDumpGradsBehindDeviceMemory) {
  const std::string dir = fresh_dir("devmem_resume");
  // 6 steps straight on the CPU; 4 behind device memory, then resumed there to 6 (the resume
  // reads the checkpoint into device memory: master weights, moments, scaler state).
  ASSERT_EQ(run(train_cmd(dir, "straight", 6, "--resume none --set fp16.enabled=true")).rc, 0);
  ASSERT_EQ(run(kCheck + train_cmd(dir, "dev", 4, "--resume none --set fp16.enabled=true")).rc, 0);
  const Result r = run(kCheck + train_cmd(dir, "dev", 6, "--resume auto --set fp16.enabled=true"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE((r.out + r.err).find("resumed from"), std::string::npos) << r.out;
  const auto want = losses(dir + "/straight.jsonl"), got = losses(dir + "/dev.jsonl");
  ASSERT_EQ(want.size(), 6u);
  for (const auto& [step, loss] : want) EXPECT_EQ(got.at(step), loss) << "step " << step;
  // --dump-grads: the gathered weights and gradients, bit for bit.
  ASSERT_EQ(run(kDstrain + " configs/tiny.yaml --resume none --dump-grads " + dir + "/cpu.h5").rc, 0);
  const Result d = run(kCheck + kDstrain + " configs/tiny.yaml --resume none --dump-grads " + dir + "/dev.h5");
  ASSERT_EQ(d.rc, 0) << d.err;
  io::H5File a(dir + "/cpu.h5", io::H5File::Mode::kRead), b(dir + "/dev.h5", io::H5File::Mode::kRead);
  int tensors = 0;
  for (const char* group : {"weights", "grads"})
    for (const std::string& name : a.list(group)) {
      EXPECT_EQ(a.read_floats(std::string(group) + "/" + name), b.read_floats(std::string(group) + "/" + name))
          << group << "/" << name;
      ++tensors;
    }
  EXPECT_GT(tensors, 20);
  // The GPU check's comparison tool on these files: equal within any tolerance; an fp32 and a bf16
  // dump differ beyond 1e-6 (named, exit 1) but not beyond their scale; a missing file is an error.
  const std::string ckpt = std::string(DSTRAIN_CKPT_BIN) + " compare-dumps ";
  Result c = run(ckpt + dir + "/cpu.h5 " + dir + "/dev.h5 0");
  EXPECT_EQ(c.rc, 0) << c.out << c.err;
  EXPECT_NE(c.out.find("0 over 0"), std::string::npos) << c.out;
  ASSERT_EQ(run(kDstrain + " configs/tiny.yaml --resume none --set bf16.enabled=true --dump-grads " + dir + "/bf16.h5").rc, 0);
  c = run(ckpt + dir + "/cpu.h5 " + dir + "/bf16.h5 1e-6");
  EXPECT_EQ(c.rc, 1);
  EXPECT_NE(c.out.find("grads/model.layers.0.self_attn"), std::string::npos) << c.out;
  EXPECT_EQ(run(ckpt + dir + "/cpu.h5 " + dir + "/bf16.h5 1").rc, 0);
  c = run(ckpt + dir + "/cpu.h5 " + dir + "/missing.h5 1e-4");
  EXPECT_EQ(c.rc, 1);
  EXPECT_NE(c.err.find("dstrain-ckpt: error"), std::string::npos) << c.err;
}

// The overflow and divergence checks read gradients through the backend: an fp16 overflow
// injected into device memory skips exactly one step; the same in bf16 stops the run as diverged,
// naming the first non-finite gradient (read back from device memory).
TEST(DeviceMemory, OverflowAndDivergenceChecksReadDeviceMemory) {
  const std::string dir = fresh_dir("devmem_inf");
  const std::string fault = "DSTRAIN_FAULT_INJECT=inf_grad:3 ";
  Result r = run(fault + kCheck + train_cmd(dir, "fp16", 4, "--resume none --set fp16.enabled=true"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(count(r.out + r.err, "step 3: fp16 gradients overflowed"), 1) << r.err;
  r = run(fault + kCheck + train_cmd(dir, "bf16", 4, "--resume none --set bf16.enabled=true"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("training diverged (the first non-finite gradient is in"), std::string::npos) << r.err;
}

TEST(Device, TheDeviceKeySelectsTheBackendOrSaysWhyNot) {
  const std::string dir = fresh_dir("device_key");
  const Result cpu = run(train_cmd(dir, "cpu", 1, "--resume none --set device=cpu"));
  ASSERT_EQ(cpu.rc, 0) << cpu.err;
  EXPECT_NE((cpu.out + cpu.err).find("cpu ("), std::string::npos) << cpu.out;
  // This machine has no usable GPU (CI never has one): cuda is refused with the reason.
  const Result cuda = run(train_cmd(dir, "cuda", 1, "--resume none --set device=cuda"));
  if (cuda.rc == 0) GTEST_SKIP() << "a GPU is usable here";
  EXPECT_NE(cuda.err.find("device: cuda"), std::string::npos) << cuda.err;
  const Result bad = run(train_cmd(dir, "bad", 1, "--resume none --set device=tpu"));
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.err.find("device"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("cuda"), std::string::npos) << bad.err;  // the valid values are named
}

// --dump-grads of every kind of layout behind device memory against one rank: tensor and
// sequence parallelism (the tensor-parallel calls without the host staging buffer), ZeRO-2's
// bucketed reduce-scatter, pipelines — zero-bubble, interleaved (activations wrapping from the
// last stage to the first), GPipe over 4 micro-batches — whose transfers are grouped as NCCL
// needs them (the W queue's copies in device memory, the MTP module's embedding mirror), expert
// parallelism's token exchanges, and combinations. The device buffers move through a
// communicator with NCCL's ordering (an operation starts when the ones before it on its
// communicator are complete), so a schedule that would hang on NCCL fails here.
TEST(DeviceMemory, EveryLayoutMatchesOneRankBehindDeviceMemory) {
  const std::string dir = fresh_dir("devmem_layouts");
  const std::string base = kDstrain + " configs/tiny.yaml --resume none --set model.num_nextn_predict_layers=1 --dump-grads ";
  struct Case {
    int np;
    std::string model, layout;  // `model`: the settings the one-rank reference shares
  };
  const std::string four = " --set model.num_hidden_layers=4", micro2 = " --set train_micro_batch_size_per_gpu=2 --set gradient_accumulation_steps=4";
  const std::vector<Case> cases = {
      {2, "", " --set parallel.tensor=2 --set parallel.sequence_parallel=true"},
      {2, "", " --set zero_optimization.stage=2"},
      {2, "", " --set parallel.pipeline=2 --set parallel.pipeline_schedule=zb-h1"},
      {2, four, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=interleaved --set parallel.virtual_stages=2"},
      {2, micro2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=gpipe"},
      {2, micro2, " --set parallel.pipeline=2 --set parallel.pipeline_schedule=1f1b"},
      {2, "", " --set parallel.expert=2"},
      {4, "", " --set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.sequence_parallel=true"},
      {4, "", " --set parallel.expert=2 --set parallel.tensor=2 --set zero_optimization.stage=1"},
  };
  std::map<std::string, std::string> references;  // model settings -> the one-rank dump
  int i = 0;
  for (const Case& c : cases) {
    if (!references.count(c.model)) {
      const std::string ref = dir + "/one" + std::to_string(references.size()) + ".h5";
      ASSERT_EQ(run(base + ref + c.model).rc, 0) << c.model;
      references[c.model] = ref;
    }
    const std::string path = dir + "/layout" + std::to_string(i++) + ".h5";
    const Result r = run(kCheck + mpirun(c.np) + base + path + c.model + c.layout);
    ASSERT_EQ(r.rc, 0) << c.model << c.layout << r.err;
    expect_same_dump(references[c.model], path, c.model + c.layout);
  }
}

// Training on 2 stages x 2 data-parallel ranks (zero-bubble schedule, ZeRO-2, MTP) behind device
// memory: a save (the sharded moments gathered from device memory) and a resume, every loss and
// the final weights bit for bit those of the plain CPU run of the same layout.
TEST(DeviceMemory, PipelineAndZeroTrainingSaveAndResumeBehindDeviceMemory) {
  const std::string dir = fresh_dir("devmem_3d");
  const std::string layout = " --set parallel.pipeline=2 --set parallel.pipeline_schedule=zb-h1"
                             " --set zero_optimization.stage=2 --set model.num_nextn_predict_layers=1";
  Result r = run(mpirun(4) + train_cmd(dir, "plain", 6, "--resume none" + layout));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run(kCheck + mpirun(4) + train_cmd(dir, "dev", 4, "--resume none" + layout));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE((r.out + r.err).find("behind checked device memory x 2 pipeline stages x 2 data-parallel ranks"),
            std::string::npos) << r.out;
  r = run(kCheck + mpirun(4) + train_cmd(dir, "dev", 6, "--resume auto" + layout));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE((r.out + r.err).find("resumed from"), std::string::npos) << r.out;
  expect_identical(dir, "plain", "dev", 6);
}

}  // namespace
}  // namespace dstrain::testing
