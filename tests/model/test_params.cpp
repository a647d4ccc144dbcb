// Parameters: counter-based RNG, layout-invariant initialisation (any TP / EP / PP shard of a
// tensor holds exactly the elements a single rank generates), initial values, flat buffers, and
// the aux-loss-free router bias update.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "engine/common/rng.h"
#include "engine/config/presets.h"
#include "engine/model/deepseek_model.h"
#include "engine/model/ffn.h"
#include "engine/model/param_store.h"
#include "engine/plan/parallel_plan.h"
#include "tests/unit/test_helpers.h"

namespace dstrain {
namespace {

// Random123's known-answer vectors for Philox4x32-10.
TEST(Rng, PhiloxKnownAnswers) {
  using A = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32({0, 0, 0, 0}, {0, 0}), (A{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}), (A{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (A{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Rng, StreamsDependOnSeedAndName) {
  EXPECT_NE(stream_key(1, "a.weight"), stream_key(2, "a.weight"));
  EXPECT_NE(stream_key(1, "a.weight"), stream_key(1, "b.weight"));
  EXPECT_EQ(normal_at(stream_key(1, "x"), 17), normal_at(stream_key(1, "x"), 17));
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double z = normal_at(99, uint64_t(i));
    sum += z, sq += z * z;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.01);
}

plan::ParallelPlan small_plan(int tp, int pp, int ep) {
  const auto cfg = testing::load("train_batch_size: 16\nmodel:\n  preset: small\n",
                                 {"parallel.tensor=" + std::to_string(tp),
                                  "parallel.pipeline=" + std::to_string(pp),
                                  "parallel.expert=" + std::to_string(ep)});
  return plan::make_plan(cfg, tp * pp * ep);
}

// Every rank of a TP=2 x PP=2 x EP=2 layout initialises its slices to exactly the values of
// the single-rank model.
TEST(ParamStore, InitialisationIsLayoutInvariant) {
  const plan::ParallelPlan one = small_plan(1, 1, 1);
  model::ParamStore full(one.params, one.param_stage, 32, {});
  full.initialize(1234, 0.02);
  const plan::ParallelPlan p = small_plan(2, 2, 2);
  std::map<std::string, int64_t> covered;
  for (int rank = 0; rank < p.degrees.world(); ++rank) {
    const plan::Coord c = p.grid.coord(rank);
    model::ParamStore part(p.params, p.param_stage, 32, {c.pp, c.tp, 2, c.ep, 2});
    part.initialize(1234, 0.02);
    for (const std::string& name : part.names()) {
      std::vector<float> expected(part.view(name).info->numel(), std::nanf(""));
      std::vector<float> got(expected.size(), std::nanf(""));
      full.store_full(name, expected.data());
      part.store_full(name, got.data());
      int64_t held = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i])) continue;
        ASSERT_EQ(got[i], expected[i]) << name << " element " << i << " on rank " << rank;
        ++held;
      }
      covered[name] += held;
    }
  }
  for (const std::string& name : full.names()) {
    const auto& info = *full.view(name).info;
    const int64_t copies = info.shard == plan::Shard::kReplicated ? 2 * 2  // tp x dp(=ep)
                           : info.shard == plan::Shard::kExpert   ? 2      // tp (expert-DP is 1)
                                                                  : 2;     // dp
    EXPECT_EQ(covered[name], info.numel() * copies) << name;
  }
}

TEST(ParamStore, InitialValuesFollowTheModelSpec) {
  const plan::ParallelPlan p = small_plan(1, 1, 1);
  model::ParamStore store(p.params, p.param_stage, 32, {});
  store.initialize(7, 0.02);
  const auto stats = [&](const std::string& name) {
    const auto& v = store.view(name);
    const float* x = store.param(name);
    double s = 0, q = 0;
    for (int64_t i = 0; i < v.numel; ++i) s += x[i], q += double(x[i]) * x[i];
    return std::make_pair(s / v.numel, std::sqrt(q / v.numel));
  };
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight",
                           "model.layers.1.mlp.experts.5.up_proj.weight", "model.layers.1.mlp.gate.weight"}) {
    const auto [mean, rms] = stats(name);
    EXPECT_NEAR(mean, 0.0, 0.002) << name;
    EXPECT_NEAR(rms, 0.02, 0.002) << name;
  }
  EXPECT_EQ(stats("model.norm.weight"), std::make_pair(1.0, 1.0));
  EXPECT_EQ(stats("model.layers.1.self_attn.kv_a_layernorm.weight"), std::make_pair(1.0, 1.0));
  EXPECT_EQ(stats("model.layers.2.mlp.gate.e_score_correction_bias").second, 0.0);
}

TEST(ParamStore, PadTokenRowStartsAtZero) {
  const plan::ParallelPlan p = small_plan(1, 1, 1);
  model::ParamStore store(p.params, p.param_stage, 32, {});
  store.initialize(7, 0.02, 10);
  const float* row = store.param("model.embed_tokens.weight") + 10 * 256;
  for (int c = 0; c < 256; ++c) EXPECT_EQ(row[c], 0.0f);
  EXPECT_NE(row[256], 0.0f);  // the next row is untouched
}

TEST(ParamStore, DenseAndExpertBuffersHoldTheirParameters) {
  const plan::ParallelPlan p = small_plan(1, 1, 1);
  model::ParamStore store(p.params, p.param_stage, 32, {});
  EXPECT_EQ(store.num_params(), p.counts.total);
  int64_t experts = 0;
  for (const auto& info : p.params)
    if (info.shard == plan::Shard::kExpert) experts += info.numel();
  EXPECT_EQ(int64_t(store.expert_params().size()), experts);
  EXPECT_EQ(int64_t(store.buffers().size()), p.counts.buffers);
  // Gate and up projections of every SwiGLU block are adjacent (one fused GEMM).
  EXPECT_EQ(store.param("model.layers.0.mlp.up_proj.weight"),
            store.param("model.layers.0.mlp.gate_proj.weight") + 768 * 256);
  EXPECT_EQ(store.param("model.layers.3.mlp.experts.31.up_proj.weight"),
            store.param("model.layers.3.mlp.experts.31.gate_proj.weight") + 192 * 256);
}

TEST(RouterBias, MovesTowardsBalance) {
  std::vector<float> bias = {0.0f, 0.5f, -0.5f, 0.0f};
  const int64_t loads[] = {10, 2, 6, 6};  // mean 6
  model::update_router_bias(bias.data(), loads, 4, 0.01f);
  EXPECT_FLOAT_EQ(bias[0], -0.01f);  // overloaded
  EXPECT_FLOAT_EQ(bias[1], 0.51f);   // underloaded
  EXPECT_FLOAT_EQ(bias[2], -0.5f);   // at the mean
  EXPECT_FLOAT_EQ(bias[3], 0.0f);
}

}  // namespace
}  // namespace dstrain

namespace dstrain::model {
namespace {

// The plan's activation memory (plan::instance_activation_memory: what the memory check and
// --dry-run use) against what the model allocates, for each preset at a few batch shapes, with
// MTP, and under each recomputation mode: within 2% (the plan mirrors the buffers).
TEST(MemoryEstimate, ActivationsMatchWhatTheModelAllocates) {
  // The LM head in its automatic chunk (the whole micro-batch here) and in chunks of 7 rows.
  for (const int64_t chunk : {0, 7})
  for (const char* preset : {"tiny", "small"})
    for (const auto& [B, S] : {std::pair<int64_t, int64_t>{2, 32}, {4, 64}}) {
      config::ModelConfig m = config::model_preset(preset);
      for (const int64_t mtp : {int64_t(0), int64_t(1)}) {
        m.num_nextn_predict_layers = mtp;
        const auto table = plan::build_param_table(m);
        const std::vector<int> stages(table.size(), 0);
        ParamStore params(table, stages, m.num_routed(), {});
        auto be = kernels::make_cpu_backend(1);
        LocalCollectives coll;
        double saved_none = 0, saved_selective = 0;
        for (const auto& [enabled, granularity, layers] :
             {std::tuple<bool, config::CheckpointGranularity, std::optional<int64_t>>{false, {}, {}},
              {true, config::CheckpointGranularity::kSelective, {}},
              {true, config::CheckpointGranularity::kFull, {}},
              {true, config::CheckpointGranularity::kFull, 1}}) {
          config::ActivationCheckpointingConfig ac;
          ac.enabled = enabled, ac.granularity = granularity, ac.num_layers = layers;
          StageSpec spec;
          spec.recompute = recompute_mode(ac), spec.recompute_layers = layers.value_or(-1);
          spec.loss_chunk_rows = chunk;
          DeepSeekModel net(m, *be, coll, params, B, S, false, spec);
          plan::InstanceShape shape;
          shape.end_layer = m.num_hidden_layers, shape.micro_batch = B, shape.seq_length = S, shape.checkpointing = ac;
          shape.loss_chunk_tokens = chunk;
          const plan::ActivationMemory want = plan::instance_activation_memory(m, shape);
          const std::string what = fmt::format("{} B {} S {} mtp {} recompute {} layers {} head chunk {}", preset, B, S,
                                               mtp, int(spec.recompute), spec.recompute_layers, net.loss_chunk_rows());
          const double saved = double(net.saved_activation_bytes()), work = double(net.workspace_bytes());
          EXPECT_NEAR(want.saved(), saved, 0.02 * saved) << what;
          EXPECT_NEAR(want.recomputed, double(net.activation_store().recomputed_bytes()), 0.02 * saved) << what;
          EXPECT_NEAR(want.workspace, work, 0.02 * work) << what;
          if (!enabled) {
            saved_none = saved;
          } else if (granularity == config::CheckpointGranularity::kSelective) {
            EXPECT_LT(saved, saved_none) << what;
            saved_selective = saved;
          } else if (!layers) {
            EXPECT_LT(saved, saved_selective) << what;
          }
        }
      }
    }
}

}  // namespace
}  // namespace dstrain::model
