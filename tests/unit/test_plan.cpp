// make_plan and its parts: DeepSpeed's batch triangle, stage assignment, FLOPs (docs/model.md §8),
// memory by ZeRO stage, and the dry-run report.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <map>

#include "engine/config/load_config.h"
#include "engine/config/presets.h"
#include "engine/plan/memory.h"
#include "engine/plan/parallel_plan.h"
#include "engine/plan/report.h"
#include "tests/unit/test_helpers.h"

namespace dstrain::plan {
namespace {

using testing::load;

config::TrainConfig with_batch(std::optional<int64_t> tb, std::optional<int64_t> mb,
                               std::optional<int64_t> ga) {
  config::TrainConfig c = load(testing::base_yaml());
  c.train_batch_size = tb;
  c.train_micro_batch_size_per_gpu.reset();
  if (mb) c.train_micro_batch_size_per_gpu = config::AutoInt{*mb};
  c.gradient_accumulation_steps = ga;
  return c;
}

TEST(BatchPlan, AnyTwoGiveTheThird) {
  struct Row {
    std::optional<int64_t> tb, mb, ga;
    int64_t dp, global, micro, accum;
  };
  const Row rows[] = {
      {32, 4, 2, 4, 32, 4, 2},           {32, 4, std::nullopt, 4, 32, 4, 2},
      {32, std::nullopt, 2, 4, 32, 4, 2}, {4, 2, 2, 1, 4, 2, 2},
      {std::nullopt, 4, 2, 4, 32, 4, 2}, {32, std::nullopt, std::nullopt, 4, 32, 8, 1},
      {std::nullopt, 4, std::nullopt, 4, 16, 4, 1},
  };
  for (const Row& r : rows) {
    const BatchPlan b = resolve_batch(with_batch(r.tb, r.mb, r.ga), r.dp);
    EXPECT_EQ(b.global, r.global);
    EXPECT_EQ(b.micro, r.micro);
    EXPECT_EQ(b.accumulation, r.accum);
    EXPECT_EQ(b.global, b.micro * b.accumulation * r.dp);
  }
}

TEST(BatchPlan, TokensPerStep) {
  const BatchPlan b = resolve_batch(load(testing::base_yaml() + "seq_length: 100\n"), 2);
  EXPECT_EQ(b.tokens_per_step(), 800);
}

TEST(Stages, UniformWithRemainderOnEarlyStages) {
  config::ModelConfig m = config::model_preset("deepseek-v3");
  config::ParallelConfig p;
  p.pipeline = 16;
  const auto stages = assign_stages(m, p);
  ASSERT_EQ(stages.size(), 16u);
  int64_t next = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    EXPECT_EQ(stages[s].first_layer, next);
    EXPECT_EQ(stages[s].num_layers(), s < 13 ? 4 : 3);
    EXPECT_EQ(stages[s].has_embedding, s == 0);
    EXPECT_EQ(stages[s].has_head, s == 15);
    next = stages[s].end_layer;
  }
  EXPECT_EQ(next, 61);
}

TEST(Plan, ExplicitStageLayersAndParamPlacement) {
  const auto cfg = load("train_batch_size: 8\nmodel:\n  preset: small\n"
                        "parallel:\n  pipeline: 2\n  stage_layers: [3, 1]\n",
                        {"model.num_nextn_predict_layers=1"});
  const ParallelPlan p = make_plan(cfg, 2);
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_EQ(p.stages[0].num_layers(), 3);
  EXPECT_EQ(p.stages[1].num_layers(), 1);
  for (size_t i = 0; i < p.params.size(); ++i) {
    const ParamInfo& info = p.params[i];
    int expected = info.layer < 0 ? 0 : info.layer < 3 ? 0 : 1;  // MTP (layer 4) and head: last
    EXPECT_EQ(p.param_stage[i], expected) << info.name;
  }
}

// Per rank, the stage load equals the sum of the rank's shards; per parameter, the shards of all
// ranks add up to the number of copies its shard rule implies.
TEST(Plan, ShardsAddUpPerRankAndPerParameter) {
  for (const std::string sets : {"1,1,1", "2,1,1", "1,2,2", "2,2,2", "4,1,4"}) {
    const int tp = sets[0] - '0', pp = sets[2] - '0', ep = sets[4] - '0';
    const auto cfg = load("train_batch_size: 16\nmodel:\n  preset: small\n",
                          {"parallel.tensor=" + std::to_string(tp),
                           "parallel.pipeline=" + std::to_string(pp),
                           "parallel.expert=" + std::to_string(ep)});
    const int world = tp * pp * ep * 2;
    const ParallelPlan p = make_plan(cfg, world);
    const int dp = p.degrees.dp;
    EXPECT_EQ(dp, 2 * ep);
    std::vector<int64_t> per_param(p.params.size(), 0);
    for (int r = 0; r < world; ++r) {
      int64_t held = 0;
      for (size_t i = 0; i < p.params.size(); ++i) {
        if (p.params[i].buffer) continue;
        const int64_t n = p.shard(i, r).local_numel();
        held += n;
        per_param[i] += n;
      }
      EXPECT_EQ(held, p.stage_loads[p.stage_of_rank(r)].params()) << sets << " rank " << r;
    }
    for (size_t i = 0; i < p.params.size(); ++i) {
      const ParamInfo& info = p.params[i];
      if (info.buffer) continue;
      const int64_t copies = info.shard == Shard::kReplicated ? tp * dp
                             : info.shard == Shard::kExpert   ? tp * (dp / ep)
                                                              : dp;
      ASSERT_EQ(per_param[i], info.numel() * copies) << info.name << " " << sets;
    }
  }
}

TEST(Plan, ResolvedConfigCarriesTheBatchTriangleAndDataDegree) {
  const ParallelPlan p = make_plan(load(testing::base_yaml()), 4);
  EXPECT_EQ(p.config.parallel.data.value, 4);
  EXPECT_EQ(p.config.train_micro_batch_size_per_gpu->value, 2);
  EXPECT_EQ(p.config.gradient_accumulation_steps, 1);
}

TEST(Plan, ShardOfARankOnAnotherStageHoldsNothing) {
  const auto cfg = load(testing::base_yaml() + "parallel:\n  pipeline: 2\n");
  const ParallelPlan p = make_plan(cfg, 2);
  // params[0] is the embedding: stage 0 (rank 0) holds it, stage 1 (rank 1) does not.
  EXPECT_TRUE(p.shard(0, 0).held);
  EXPECT_FALSE(p.shard(0, 1).held);
}

// docs/model.md §8's table, at its sequence lengths.
TEST(Flops, MatchTheModelSpecTable) {
  const FlopsPerToken tiny = flops_per_token(config::model_preset("tiny"), 128);
  EXPECT_EQ(tiny.attn_proj, 36'864);
  EXPECT_EQ(tiny.attn_core, 20'480);
  EXPECT_EQ(tiny.moe, 37'376);
  EXPECT_EQ(tiny.forward, 233'984);
  EXPECT_EQ(tiny.train, 701'952);
  const auto near = [](double got, double want, double rel) {
    return std::fabs(got - want) <= rel * want;
  };
  const FlopsPerToken small = flops_per_token(config::model_preset("small"), 256);
  EXPECT_EQ(small.attn_proj, 225'280);
  EXPECT_EQ(small.attn_core, 81'920);
  EXPECT_EQ(small.moe, 1'490'944);
  EXPECT_TRUE(near(small.forward, 7.012e6, 1e-3)) << small.forward;
  EXPECT_TRUE(near(small.train, 21.04e6, 1e-3)) << small.train;
  const FlopsPerToken medium = flops_per_token(config::model_preset("medium"), 2048);
  EXPECT_TRUE(near(medium.attn_proj, 3.883e6, 1e-3));
  EXPECT_TRUE(near(medium.attn_core, 3.932e6, 1e-3));
  EXPECT_TRUE(near(medium.moe, 9.486e6, 1e-3));
  EXPECT_TRUE(near(medium.forward, 224.9e6, 1e-3));
  const FlopsPerToken lite = flops_per_token(config::model_preset("deepseek-v2-lite"), 4096);
  EXPECT_TRUE(near(lite.attn_proj, 27.53e6, 1e-3));
  EXPECT_TRUE(near(lite.moe, 138.7e6, 1e-3));
  EXPECT_TRUE(near(lite.forward, 5.469e9, 1e-3));
  config::ModelConfig v3 = config::model_preset("deepseek-v3");
  v3.num_nextn_predict_layers = 0;  // the table's row is "V3 (no MTP)"
  const FlopsPerToken f3 = flops_per_token(v3, 4096);
  EXPECT_TRUE(near(f3.attn_proj, 374.2e6, 1e-3));
  EXPECT_TRUE(near(f3.attn_core, 167.8e6, 1e-3));
  EXPECT_TRUE(near(f3.moe, 796.4e6, 1e-3));
  EXPECT_TRUE(near(f3.forward, 83.48e9, 1e-3));
  EXPECT_TRUE(near(f3.train, 250.5e9, 1e-3));
}

// MTP adds per module F_attn_proj + F_attn_core + F_moe + 4H^2 + 2HV (docs/model.md §8).
TEST(Flops, MtpModuleAddsItsLayerProjectionAndHead) {
  config::ModelConfig m = config::model_preset("tiny");
  const FlopsPerToken base = flops_per_token(m, 128);
  m.num_nextn_predict_layers = 1;
  const FlopsPerToken with_mtp = flops_per_token(m, 128);
  EXPECT_EQ(with_mtp.forward - base.forward,
            base.attn_proj + base.attn_core + base.moe + 4.0 * 64 * 64 + 2.0 * 64 * 256);
}

TEST(Memory, ZeroShardsOptimizerStateThenGradients) {
  const int64_t dense = 1'000'000, expert = 400'000, dp = 4, edp = 2;
  using config::Precision;
  const MemoryEstimate z0 = estimate_memory(dense, expert, dp, edp, 0, Precision::kFp32);
  const MemoryEstimate z1 = estimate_memory(dense, expert, dp, edp, 1, Precision::kFp32);
  const MemoryEstimate z2 = estimate_memory(dense, expert, dp, edp, 2, Precision::kFp32);
  EXPECT_EQ(z0.weights, 4.0 * 1'400'000);
  EXPECT_EQ(z0.optimizer, 8.0 * 1'400'000);
  EXPECT_EQ(z1.optimizer, 8.0 * (dense / dp + expert / edp));  // unsharded bytes / DP
  EXPECT_EQ(z1.gradients, z0.gradients);
  EXPECT_EQ(z2.gradients, 4.0 * (dense / dp + expert / edp));
  EXPECT_EQ(z2.weights, z0.weights);
  const MemoryEstimate b1 = estimate_memory(dense, expert, dp, edp, 1, Precision::kBf16, 5'000);
  EXPECT_EQ(b1.weights, 2.0 * 1'400'000 + 4.0 * 5'000);  // the 16-bit copy + the fp32 side copies
  EXPECT_EQ(b1.optimizer, 12.0 * (dense / dp + expert / edp));  // fp32 master + m + v
  // DeepSpeed's / Megatron's bytes at ZeRO-0: 2 + 4 + 4 + 8 = 18 per parameter (plus the side).
  const MemoryEstimate b0 = estimate_memory(dense, expert, dp, edp, 0, Precision::kBf16);
  EXPECT_EQ(b0.total(), 18.0 * 1'400'000);
}

// ZeRO-2 holds a gradient shard only where it reduces every micro-batch during the backward pass
// (no pipeline, overlap_comm, gradients in host memory): the plan then counts the shard and a
// window of the largest set of gradients final together (here a MoE layer) with the bucket being
// filled and four in flight; elsewhere the whole buffer.
TEST(Memory, ZeroTwoCountsTheShardAndItsWindowWhereItHoldsOne) {
  const std::vector<std::string> z2 = {"zero_optimization.stage=2", "zero_optimization.reduce_bucket_size=65536",
                                       "train_batch_size=16"};
  const ParallelPlan p = make_plan(config::load_config_file("configs/small.yaml", z2), 2);
  ASSERT_TRUE(p.holds_gradient_shard(2));
  EXPECT_FALSE(p.holds_gradient_shard(1));
  std::map<int64_t, int64_t> per_layer;
  const int64_t L = p.config.model.num_hidden_layers;
  for (const ParamInfo& info : p.params)
    if (!info.buffer) per_layer[std::min(info.layer, L)] += info.numel();
  int64_t largest = 0;
  for (const auto& [layer, n] : per_layer) largest = std::max(largest, n);
  const StageLoad& s = p.stage_loads[0];
  const int64_t shard = (s.dense_params + 1) / 2 + (s.expert_params + 1) / 2;
  EXPECT_EQ(p.gradient_window(0), largest + 5 * 65536);
  EXPECT_LT(p.gradient_window(0), s.params() - shard);
  EXPECT_EQ(p.memory(0, 2, config::Precision::kFp32).gradients, 4.0 * double(shard + largest + 5 * 65536));
  // Large buckets: the window is at most the rest of the buffer.
  const ParallelPlan big = make_plan(config::load_config_file("configs/small.yaml", {"zero_optimization.stage=2",
                                                                                     "train_batch_size=16"}), 2);
  EXPECT_EQ(big.gradient_window(0), s.params() - shard);
  // No shard held: the whole buffer, as ZeRO-1.
  const std::vector<std::vector<std::string>> whole = {
      {"zero_optimization.overlap_comm=false"}, {"parallel.pipeline=2"}, {"parallel.pipeline_schedule=zb-h1"}};
  for (std::vector<std::string> extra : whole) {
    extra.insert(extra.end(), z2.begin(), z2.end());
    const ParallelPlan q = make_plan(config::load_config_file("configs/small.yaml", extra), 4);
    EXPECT_FALSE(q.holds_gradient_shard(2)) << extra[0];
    EXPECT_EQ(q.memory(0, 2, config::Precision::kFp32).gradients, q.memory(0, 1, config::Precision::kFp32).gradients)
        << extra[0];
  }
  ParallelPlan gpu = p;
  gpu.gradients_in_device_memory = true;
  EXPECT_FALSE(gpu.holds_gradient_shard(2));
  EXPECT_EQ(gpu.memory(0, 2, config::Precision::kFp32).gradients, 4.0 * double(s.params()));
}

// gradient_compression: the plan counts PowerSGD's memory — per compressed buffer an fp32
// error (with error feedback), Q and the staging of the whole part and P — from the same split
// the compression makes, and none where no group has more than one rank.
TEST(Memory, PowerSgdCountsItsErrorFeedbackQAndStaging) {
  const std::vector<std::string> psgd = {"zero_optimization.stage=1", "gradient_compression.rank=4",
                                         "train_batch_size=16"};
  const ParallelPlan p = make_plan(config::load_config_file("configs/small.yaml", psgd), 4);
  const std::array<PowerSgdLayout, 2> l = p.powersgd_layouts(0);
  const StageLoad& s = p.stage_loads[0];
  ASSERT_EQ(l[0].length, s.dense_params);
  ASSERT_EQ(l[1].length, s.expert_params);
  double want = 0;
  for (const PowerSgdLayout& x : l) {
    EXPECT_GT(x.matrices.size(), 0u);
    EXPECT_LT(x.compressed_elems() * 10, x.length);
    want += 4.0 * double(x.length + x.whole_elems + x.p_elems + x.q_elems);
  }
  const MemoryEstimate m = p.memory(0, 1, config::Precision::kFp32);
  EXPECT_EQ(m.compression, want);
  EXPECT_EQ(m.total(), m.weights + m.gradients + m.optimizer + want);
  EXPECT_EQ(m.total() - want, make_plan(config::load_config_file("configs/small.yaml", {"zero_optimization.stage=1",
                                                                                        "train_batch_size=16"}),
                                        4)
                                  .memory(0, 1, config::Precision::kFp32)
                                  .total());
  std::vector<std::string> no_feedback = psgd;
  no_feedback.push_back("gradient_compression.use_error_feedback=false");
  EXPECT_EQ(make_plan(config::load_config_file("configs/small.yaml", no_feedback), 4)
                .memory(0, 1, config::Precision::kFp32)
                .compression,
            want - 4.0 * double(l[0].length + l[1].length));
  const ParallelPlan one = make_plan(config::load_config_file("configs/small.yaml", psgd), 1);
  EXPECT_EQ(one.memory(0, 1, config::Precision::kFp32).compression, 0.0);
  EXPECT_EQ(one.powersgd_layouts(0)[0].length, 0);
}

// The tensors read in fp32 under mixed precision (their side copies): norms, biases, routers —
// never a GEMM's weight, the embedding or an expert's.
TEST(Memory, OnlyNormsBiasesAndRoutersAreReadInFp32) {
  const ParallelPlan p = make_plan(load(testing::base_yaml(), {"bf16.enabled=true"}), 1);
  int64_t side = 0, norms = 0, routers = 0;
  for (const ParamInfo& i : p.params) {
    if (!read_in_fp32(i)) continue;
    side += (i.numel() + 15) / 16 * 16;
    EXPECT_TRUE(i.shape.size() == 1 || i.name.find(".mlp.gate.weight") != std::string::npos) << i.name;
    norms += i.name.find("norm.weight") != std::string::npos;
    routers += i.name.find(".mlp.gate.weight") != std::string::npos;
  }
  EXPECT_GT(norms, 0);
  EXPECT_GT(routers, 0);
  EXPECT_EQ(p.stage_loads[0].fp32_read, side);
  EXPECT_LT(double(side), 0.05 * double(p.stage_loads[0].params()));  // small beside the GEMMs' weights
  const MemoryEstimate m = p.memory(0, 0, config::Precision::kBf16);
  EXPECT_EQ(m.weights, 2.0 * double(p.stage_loads[0].params()) + 4.0 * double(side));
}

// The LM head's chunk (docs/design.md §6.13): automatic — the logits of a chunk as large as the
// [N, H] hidden states, at least kMinLossChunk rows within 1 GiB of logits, at most N; or asked
// for (kernels.loss_chunk_tokens, also from DSTRAIN_LOSS_CHUNK_TOKENS when the config is loaded,
// whose bad values are refused by name).
TEST(Memory, LossChunkRows) {
  EXPECT_EQ(plan::loss_chunk_rows(8192, 2048, 102400), plan::kMinLossChunk);  // h200: 164 rows would do
  EXPECT_EQ(plan::loss_chunk_rows(65536, 2048, 51200), 2622);                 // ceil(65536 * 2048 / 51200)
  EXPECT_EQ(plan::loss_chunk_rows(16384, 768, 8192), plan::kMinLossChunk);
  EXPECT_EQ(plan::loss_chunk_rows(512, 256, 256), 512);  // small: one chunk
  // A vocabulary of a million: 268 rows (1 GiB of logits), not 2,048 (8 GB); the hidden-state
  // rule wins where it asks for more.
  EXPECT_EQ(plan::loss_chunk_rows(1'024'000, 64, 1'000'000), (int64_t(1) << 28) / 1'000'000);
  EXPECT_EQ(plan::loss_chunk_rows(16'000'000, 7168, 1'000'000), 114'688);
  EXPECT_EQ(plan::loss_chunk_rows(512, 256, 256, 100), 100);
  EXPECT_EQ(plan::loss_chunk_rows(512, 256, 256, 1000), 512);
  // From the environment, through the config as it is loaded (the only place it is read).
  setenv("DSTRAIN_LOSS_CHUNK_TOKENS", "7", 1);
  EXPECT_EQ(testing::load(testing::base_yaml()).kernels.loss_chunk_tokens, 7);
  for (const char* bad : {"-3", "12x", "lots", "99999999999999999999"}) {
    setenv("DSTRAIN_LOSS_CHUNK_TOKENS", bad, 1);
    try {
      testing::load(testing::base_yaml());
      ADD_FAILURE() << bad << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("DSTRAIN_LOSS_CHUNK_TOKENS=") + bad), std::string::npos)
          << e.what();
    }
  }
  unsetenv("DSTRAIN_LOSS_CHUNK_TOKENS");
  EXPECT_EQ(testing::load(testing::base_yaml()).kernels.loss_chunk_tokens, 0);
}

TEST(Report, NamesEveryFigureAUserChecks) {
  const auto cfg = config::load_config_file("configs/deepseek-v3.yaml");
  const std::string r = dry_run_report(make_plan(cfg, 2048));
  for (const char* s : {"671,026,404,352", "37,552,282,624", "11,610,067,968",
                        "train_batch_size 15360 = micro 1 x accumulation 120 x data-parallel 128",
                        "world 2048 = tensor 1 x pipeline 16 x data 128; expert 64",
                        "dp   16 group(s) of 128", "ep   32 group(s) of 64",
                        "edp  1024 group(s) of 2: [0 64] [1 65]", "stage 15  layers 58-60 (3)",
                        "ZeRO-1", "per step"})
    EXPECT_NE(r.find(s), std::string::npos) << s << "\n" << r;
}

// train_micro_batch_size_per_gpu: auto picks the largest micro-batch dividing the per-rank batch
// whose plan fits the budget: between the needs of micro 4 and 8 it takes 4; the same budget
// takes 8 once full recomputation shrinks the activations; every candidate fits a huge budget;
// none fits a tiny one, which is refused with the smallest need.
TEST(AutoMicroBatch, PicksTheLargestThatFits) {
  const std::string yaml = "train_batch_size: 16\nseq_length: 128\nmodel:\n  preset: small\n";
  const auto need = [&](int64_t micro, const std::vector<std::string>& sets) {
    std::vector<std::string> all = sets;
    all.push_back("train_micro_batch_size_per_gpu=" + std::to_string(micro));
    const ParallelPlan p = make_plan(load(yaml, all), 1);
    EXPECT_FALSE(p.auto_micro);
    return p.rank_need(0);
  };
  const double n4 = need(4, {}), n8 = need(8, {});
  ASSERT_LT(n4, n8);
  const double budget = (n4 + n8) / 2;
  const auto pick = [&](std::vector<std::string> sets, double gib) {
    sets.push_back("train_micro_batch_size_per_gpu=auto");
    sets.push_back(fmt::format("memory_budget_gib={}", gib));
    return make_plan(load(yaml, sets), 1);
  };
  const ParallelPlan p = pick({}, budget / double(1ull << 30));
  ASSERT_TRUE(p.auto_micro);
  EXPECT_EQ(p.batch.micro, 4);
  EXPECT_EQ(p.batch.accumulation, 4);
  EXPECT_EQ(p.batch.global, 16);
  EXPECT_EQ(p.auto_micro->larger, 8);
  EXPECT_NEAR(p.auto_micro->need, n4, 1.0);
  EXPECT_NEAR(p.auto_micro->larger_need, n8, 1.0);
  EXPECT_NE(dry_run_report(p).find("micro-batch auto: 4 needs"), std::string::npos);
  // The same budget with full recomputation: the activations of 8 sequences now fit.
  const std::vector<std::string> full = {"activation_checkpointing.enabled=true"};
  ASSERT_LT(need(8, full), budget);
  EXPECT_EQ(pick(full, budget / double(1ull << 30)).batch.micro, 8);
  EXPECT_EQ(pick({}, 1000.0).batch.micro, 16);
  try {
    pick({}, 0.001);
    ADD_FAILURE() << "a budget nothing fits was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("even a micro-batch of 1 needs"), std::string::npos) << e.what();
  }
}

TEST(AutoMicroBatch, RefusesWhatItCannotKeep) {
  const auto refused = [](const std::vector<std::string>& sets, const std::string& want) {
    try {
      make_plan(load(testing::base_yaml(), sets), 1, 1e9);
      ADD_FAILURE() << "accepted: " << want;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  refused({"train_micro_batch_size_per_gpu=auto", "gradient_accumulation_steps=2"},
          "gradient_accumulation_steps: 2, but train_micro_batch_size_per_gpu is auto");
  refused({"train_micro_batch_size_per_gpu=auto", "train_batch_size=null"},
          "train_micro_batch_size_per_gpu: auto needs train_batch_size");
  // No budget given and none known (host_share_bytes 0).
  try {
    make_plan(load(testing::base_yaml(), {"train_micro_batch_size_per_gpu=auto"}), 1, 0.0);
    ADD_FAILURE() << "no budget accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("memory_budget_gib: null"), std::string::npos) << e.what();
  }
  // The host's share is the budget when the key is null.
  EXPECT_EQ(make_plan(load(testing::base_yaml(), {"train_micro_batch_size_per_gpu=auto"}), 1, 1e12).batch.micro, 8);
}

// The model instances a chunk's pool grows to: GPipe holds all four micro-batches on rank 0,
// 1F1B two on rank 0 and one on the last rank; interleaved pools add up to at least the rank's
// simulated peak (a chunk's pool is sized for its own peak).
TEST(Plan, ChunkInFlightFollowsTheSchedule) {
  const auto plan_of = [](const std::string& kind, int v) {
    return make_plan(load(testing::base_yaml(), {"parallel.pipeline=2", "train_micro_batch_size_per_gpu=2",
                                                 "parallel.pipeline_schedule=" + kind,
                                                 "parallel.virtual_stages=" + std::to_string(v),
                                                 "model.num_hidden_layers=4"}),
                     2);
  };
  const ParallelPlan gpipe = plan_of("gpipe", 1), one = plan_of("1f1b", 1), zb = plan_of("zb-h1", 1);
  EXPECT_EQ(gpipe.chunk_in_flight(0, 0), 4);
  EXPECT_EQ(one.chunk_in_flight(0, 0), 2);
  EXPECT_EQ(one.chunk_in_flight(1, 0), 1);
  EXPECT_EQ(zb.chunk_in_flight(0, 0), 2);
  const ParallelPlan inter = plan_of("interleaved", 2);
  EXPECT_GE(inter.chunk_in_flight(0, 0) + inter.chunk_in_flight(0, 1), inter.in_flight(0));
  // The plan's activations of a rank: each chunk's instances times its pool, without the shared
  // workspace, plus one recompute arena and one shared workspace (the largest chunk's).
  ActivationMemory want;
  double shared = 0;
  for (int c = 0; c < 2; ++c) {
    ActivationMemory m = inter.instance_activations(inter.virtual_stages_of(0)[size_t(c)]);
    EXPECT_GT(m.workspace_shared, 0.0);
    EXPECT_LT(m.workspace_shared, m.workspace);  // an instance keeps its own input gradient
    shared = std::max(shared, m.workspace_shared);
    m.recomputed = 0, m.workspace -= m.workspace_shared, m.workspace_shared = 0;
    want += m * double(inter.chunk_in_flight(0, c));
  }
  EXPECT_DOUBLE_EQ(inter.activations(0).total(), want.total() + shared);
  EXPECT_DOUBLE_EQ(inter.activations(0).workspace_shared, shared);
}

// The expert-parallel backward buffers are one set per model instance, which its MoE layers
// share (one runs its backward at a time): more MoE layers do not grow the workspace. (They
// were each layer's own: DeepSeek-V2-Lite's 26 MoE layers planned a 31.9 GiB workspace.)
TEST(Plan, ExpertParallelBackwardBuffersAreSharedByTheLayers) {
  const auto workspace = [](int layers) {
    const ParallelPlan p = make_plan(
        load(testing::base_yaml(), {"parallel.expert=2", "model.num_hidden_layers=" + std::to_string(layers)}), 2);
    return p.instance_activations(0).workspace;
  };
  EXPECT_GT(workspace(2), 0.0);
  EXPECT_DOUBLE_EQ(workspace(6), workspace(2));  // 5 MoE layers, then 1
}

// The expert-parallel receive side is planned at balanced routing plus an eighth: the plan's
// workspace grows with the margin's rows, and the model reserves the same (Monitor's
// EveryRanksBuffersMatchThePlan compares them).
TEST(Plan, ExpertReceiveBuffersAreBalancedRoutingAndAnEighth) {
  EXPECT_EQ(expert_receive_rows(800), 900);
  EXPECT_EQ(expert_receive_rows(0), 0);
  EXPECT_EQ(expert_receive_rows(7), 7);  // (an eighth rounded down)
}

// The presets plan within their GPUs (issue 43's targets; the presets' own settings: bf16, full
// recomputation, ZeRO-1, micro-batch 1 x 4096): DeepSeek-V3 at the paper's layout (TP 1, PP 16,
// EP 64 on 2048 ranks) at most 40 GiB on every rank, DeepSeek-V2-Lite on 8 ranks (EP 8) at most
// 45 GiB — 16-bit state at 18 B/param, in-flight micro-batches that hold only their saved
// activations, and one workspace per rank.
TEST(Plan, PresetsFitTheirGpus) {
  const auto worst = [](const std::string& file, int world) {
    const ParallelPlan p = make_plan(config::load_config_file(file), world);
    double need = 0;
    for (int s = 0; s < p.degrees.pp; ++s) need = std::max(need, p.rank_need(s));
    return need / double(1ull << 30);
  };
  const double v3 = worst("configs/deepseek-v3.yaml", 2048), lite = worst("configs/deepseek-v2-lite.yaml", 8);
  EXPECT_LE(v3, 40.0);
  EXPECT_GT(v3, 30.0);  // (the layout's real need, not an empty plan)
  EXPECT_LE(lite, 45.0);
  EXPECT_GT(lite, 39.0);  // its model state alone is 39.3 GiB
}

// memory_budget_gib under the plan's need: the dry run names the stage, by how much, and the part.
TEST(Plan, TheDryRunNamesTheRankThatOverflowsItsBudget) {
  const ParallelPlan p =
      make_plan(config::load_config_file("configs/deepseek-v3.yaml", {"memory_budget_gib=35"}), 2048);
  const std::string r = dry_run_report(p, {});
  EXPECT_NE(r.find("against memory_budget_gib 35.00 GiB"), std::string::npos) << r;
  EXPECT_NE(r.find("stage 0   "), std::string::npos);
  const size_t line = r.find("\n  stage 0   ", r.find("need per rank"));
  ASSERT_NE(line, std::string::npos) << r;
  EXPECT_NE(r.substr(line, r.find('\n', line + 1) - line).find("OVER the budget by"), std::string::npos) << r;
  const size_t mid = r.find("\n  stage 8   ", r.find("need per rank"));
  ASSERT_NE(mid, std::string::npos);
  EXPECT_EQ(r.substr(mid, r.find('\n', mid + 1) - mid).find("OVER"), std::string::npos) << r;
}

// What the backend runs on 16-bit inputs moves the plan's workspace, and only that: fp32
// attention adds the widened Q, K, V; the kept activations do not change, and fp32 ignores it.
// (The GEMMs always take 16-bit operands: no plan depends on how a backend multiplies them.)
TEST(Plan, SixteenBitAttentionIsCountedApart) {
  const ParallelPlan bf16 = make_plan(load(testing::base_yaml(), {"bf16.enabled=true"}), 1);
  const ActivationMemory native = bf16.activations(0, 0, {true}), widened = bf16.activations(0, 0, {false});
  EXPECT_DOUBLE_EQ(bf16.activations(0).total(), native.total());  // assumed without a backend
  EXPECT_LT(native.workspace, widened.workspace);
  EXPECT_EQ(native.kept, widened.kept);
  const ParallelPlan fp32 = make_plan(load(testing::base_yaml(), {}), 1);
  EXPECT_DOUBLE_EQ(fp32.activations(0, 0, {false}).total(), fp32.activations(0).total());
}

}  // namespace
}  // namespace dstrain::plan
