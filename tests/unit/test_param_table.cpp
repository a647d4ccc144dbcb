// The parameter registry: names and shapes in Hugging Face layout, counts equal to docs/model.md §9,
// and shard rules that tile every tensor exactly once.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "engine/config/presets.h"
#include "engine/plan/model_math.h"
#include "engine/plan/param_table.h"

namespace dstrain::plan {
namespace {

using config::ModelConfig;
using config::model_preset;

// docs/model.md §9's formulas, written independently of the table builder.
std::pair<int64_t, int64_t> formula_counts(const ModelConfig& m) {
  const int64_t H = m.hidden_size, nh = m.num_attention_heads, dqk = m.qk_head_dim();
  int64_t attn = m.q_lora_rank ? H * *m.q_lora_rank + *m.q_lora_rank + *m.q_lora_rank * nh * dqk
                               : H * nh * dqk;
  attn += H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank +
          m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) + nh * m.v_head_dim * H;
  int64_t total = H + 2 * m.vocab_size * H, activated = total;
  for (int64_t i = 0; i < m.num_hidden_layers; ++i) {
    const int64_t base = attn + 2 * H;
    if (!m.is_moe_layer(i)) {
      total += base + 3 * H * m.intermediate_size;
      activated += base + 3 * H * m.intermediate_size;
      continue;
    }
    const int64_t E = m.num_routed(), expert = 3 * H * m.moe_intermediate_size;
    const int64_t rest = base + 3 * H * m.num_shared() * m.moe_intermediate_size + E * H;
    total += rest + E * expert;
    activated += rest + m.num_experts_per_tok * expert;
  }
  return {total, activated};
}

ModelConfig deepseek_v2_236b() {  // docs/model.md §9.1, "for reference"
  ModelConfig m = model_preset("deepseek-v2-lite");
  m.hidden_size = 5120;
  m.intermediate_size = 12288;
  m.moe_intermediate_size = 1536;
  m.num_hidden_layers = 60;
  m.num_attention_heads = m.num_key_value_heads = 128;
  m.q_lora_rank = 1536;
  m.n_routed_experts = 160;
  m.n_shared_experts = 2;
  m.num_experts_per_tok = 6;
  m.n_group = 8;
  m.topk_group = 3;
  m.topk_method = config::TopkMethod::kGroupLimitedGreedy;
  return m;
}

struct Published {
  const char* preset;
  int64_t total, activated, activated_excl_embedding;
};

// docs/model.md §9 table.
TEST(ParamCounts, EqualThePublishedFigures) {
  const Published rows[] = {
      {"tiny", 125'664, 113'376, 96'992},
      {"small", 15'797'120, 3'410'816, 3'345'280},
      {"medium", 263'850'240, 95'160'576, 88'869'120},
      {"deepseek-v2-lite", 15'706'484'224, 2'661'150'208, 2'451'435'008},
      {"deepseek-v3", 671'026'404'352, 37'552'282'624, 36'625'603'584},
  };
  for (const auto& row : rows) {
    const ModelConfig m = model_preset(row.preset);
    const ParamCounts c = count_params(m, build_param_table(m));
    EXPECT_EQ(c.total, row.total) << row.preset;
    EXPECT_EQ(c.activated, row.activated) << row.preset;
    EXPECT_EQ(c.activated_excl_embedding, row.activated_excl_embedding) << row.preset;
  }
  const ModelConfig v2 = deepseek_v2_236b();
  const ParamCounts c = count_params(v2, build_param_table(v2));
  EXPECT_EQ(c.total, 235'741'434'880);
  EXPECT_EQ(c.activated, 21'375'800'320);
  EXPECT_EQ(c.activated_excl_embedding, 20'851'512'320);
}

TEST(ParamCounts, DeepSeekV3MtpModule) {
  const ModelConfig m = model_preset("deepseek-v3");
  const ParamCounts c = count_params(m, build_param_table(m));
  EXPECT_EQ(c.mtp_total, 11'610'067'968);
  EXPECT_EQ(c.mtp_activated, 688'100'352);
  EXPECT_EQ(c.buffers, (58 + 1) * 256);  // one e_score_correction_bias per MoE layer, MTP's too
}

// Random valid models: the registry and the closed-form formulas agree.
TEST(ParamCounts, MatchFormulasOnRandomModels) {
  std::mt19937 rng(7);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 200; ++trial) {
    ModelConfig m = model_preset("tiny");
    m.hidden_size = 8 * pick(1, 16);
    m.num_hidden_layers = pick(1, 6);
    m.first_k_dense_replace = pick(0, 3);
    m.moe_layer_freq = pick(1, 2);
    m.num_attention_heads = m.num_key_value_heads = pick(1, 6);
    m.q_lora_rank = pick(0, 1) ? std::optional<int64_t>(pick(4, 64)) : std::nullopt;
    m.kv_lora_rank = pick(4, 64);
    m.qk_rope_head_dim = 2 * pick(1, 8);
    m.n_routed_experts = pick(0, 3) ? std::optional<int64_t>(pick(1, 16)) : std::nullopt;
    m.n_shared_experts = pick(0, 2);
    m.num_experts_per_tok = 1;
    m.model_type = pick(0, 1) ? config::ModelType::kDeepseekV3 : config::ModelType::kDeepseekV2;
    const auto [total, activated] = formula_counts(m);
    const ParamCounts c = count_params(m, build_param_table(m));
    ASSERT_EQ(c.total, total) << "trial " << trial;
    ASSERT_EQ(c.activated, activated) << "trial " << trial;
  }
}

TEST(ParamTable, HuggingFaceNamesAndShapes) {
  const ModelConfig m = model_preset("tiny");
  std::map<std::string, ParamInfo> by_name;
  for (const auto& p : build_param_table(m)) by_name[p.name] = p;
  const auto shape = [&](const std::string& n) { return by_name.at(n).shape; };
  using S = std::vector<int64_t>;
  EXPECT_EQ(shape("model.embed_tokens.weight"), (S{256, 64}));
  EXPECT_EQ(shape("lm_head.weight"), (S{256, 64}));
  EXPECT_EQ(shape("model.norm.weight"), (S{64}));
  EXPECT_EQ(shape("model.layers.0.self_attn.q_a_proj.weight"), (S{48, 64}));
  EXPECT_EQ(shape("model.layers.0.self_attn.q_b_proj.weight"), (S{4 * 24, 48}));
  EXPECT_EQ(shape("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (S{32 + 8, 64}));
  EXPECT_EQ(shape("model.layers.0.self_attn.kv_b_proj.weight"), (S{4 * (16 + 16), 32}));
  EXPECT_EQ(shape("model.layers.0.self_attn.o_proj.weight"), (S{64, 4 * 16}));
  EXPECT_EQ(shape("model.layers.0.mlp.gate_proj.weight"), (S{128, 64}));
  EXPECT_EQ(shape("model.layers.0.mlp.down_proj.weight"), (S{64, 128}));
  EXPECT_EQ(shape("model.layers.1.mlp.gate.weight"), (S{4, 64}));
  EXPECT_EQ(shape("model.layers.1.mlp.experts.3.up_proj.weight"), (S{32, 64}));
  EXPECT_EQ(shape("model.layers.1.mlp.shared_experts.down_proj.weight"), (S{64, 32}));
  EXPECT_TRUE(by_name.at("model.layers.1.mlp.gate.e_score_correction_bias").buffer);
  EXPECT_EQ(by_name.count("model.layers.0.self_attn.q_proj.weight"), 0u);
  EXPECT_EQ(by_name.count("model.layers.0.mlp.gate.weight"), 0u);  // layer 0 is dense
}

TEST(ParamTable, WithoutQLoraThereIsOneQProjAndV2HasNoRouterBias) {
  const ModelConfig m = model_preset("deepseek-v2-lite");
  std::set<std::string> names;
  for (const auto& p : build_param_table(m)) names.insert(p.name);
  EXPECT_TRUE(names.count("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(names.count("model.layers.0.self_attn.q_a_proj.weight"));
  EXPECT_FALSE(names.count("model.layers.1.mlp.gate.e_score_correction_bias"));
  EXPECT_TRUE(names.count("model.layers.26.mlp.experts.63.down_proj.weight"));
}

TEST(ParamTable, MtpModuleNames) {
  ModelConfig m = model_preset("tiny");
  m.num_nextn_predict_layers = 1;
  std::map<std::string, ParamInfo> by_name;
  for (const auto& p : build_param_table(m)) by_name[p.name] = p;
  EXPECT_EQ(by_name.at("model.layers.2.eh_proj.weight").shape, (std::vector<int64_t>{64, 128}));
  EXPECT_TRUE(by_name.count("model.layers.2.enorm.weight"));
  EXPECT_TRUE(by_name.count("model.layers.2.hnorm.weight"));
  EXPECT_TRUE(by_name.count("model.layers.2.shared_head.norm.weight"));
  EXPECT_TRUE(by_name.count("model.layers.2.mlp.experts.0.gate_proj.weight"));
  EXPECT_EQ(by_name.at("model.layers.2.eh_proj.weight").layer, 2);
}

TEST(ParamTable, NamesAreUniqueAndDecayOnlyMatrices) {
  for (const auto& preset : config::preset_names()) {
    if (preset == "deepseek-v3") continue;  // 46k entries; covered by the counts test
    std::set<std::string> names;
    for (const auto& p : build_param_table(model_preset(preset))) {
      EXPECT_TRUE(names.insert(p.name).second) << p.name;
      EXPECT_EQ(p.weight_decay, !p.buffer && p.shape.size() == 2) << p.name;
    }
  }
}

// For TP in {1,2,4} and EP in {1,2,4}, the slices of every tensor held by the ranks cover it
// exactly once when split, and fully on every rank when replicated.
TEST(ShardSpec, SlicesTileEveryTensor) {
  const ModelConfig m = model_preset("tiny");
  for (int tp : {1, 2, 4}) {
    for (int ep : {1, 2, 4}) {
      for (const ParamInfo& p : build_param_table(m)) {
        std::vector<int> cover(p.numel(), 0);
        int holders = 0;
        for (int t = 0; t < tp; ++t) {
          for (int e = 0; e < ep; ++e) {
            const ShardSpec s = shard_of(p, m.num_routed(), t, tp, e, ep);
            if (!s.held) continue;
            ++holders;
            const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
            const int64_t lr = s.local_shape[0];
            const int64_t lc = p.shape.size() == 2 ? s.local_shape[1] : 1;
            const int64_t r0 = s.offset[0], c0 = p.shape.size() == 2 ? s.offset[1] : 0;
            for (int64_t r = 0; r < lr; ++r)
              for (int64_t c = 0; c < lc; ++c) ++cover[(r0 + r) * cols + (c0 + c)];
          }
        }
        const int per_element = p.shard == Shard::kReplicated ? tp * ep
                                : p.shard == Shard::kExpert   ? tp
                                                              : ep;
        for (int64_t i = 0; i < p.numel(); ++i)
          ASSERT_EQ(cover[i], per_element) << p.name << " tp" << tp << " ep" << ep;
        ASSERT_GT(holders, 0) << p.name;
      }
    }
  }
}

TEST(ShardSpec, RulesFollowModelSpec) {
  const ModelConfig m = model_preset("tiny");
  std::map<std::string, Shard> rule;
  for (const auto& p : build_param_table(m)) rule[p.name] = p.shard;
  EXPECT_EQ(rule["model.embed_tokens.weight"], Shard::kVocab);
  EXPECT_EQ(rule["lm_head.weight"], Shard::kVocab);
  EXPECT_EQ(rule["model.layers.0.self_attn.q_a_proj.weight"], Shard::kReplicated);
  EXPECT_EQ(rule["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"], Shard::kReplicated);
  EXPECT_EQ(rule["model.layers.0.self_attn.q_b_proj.weight"], Shard::kColumn);
  EXPECT_EQ(rule["model.layers.0.self_attn.kv_b_proj.weight"], Shard::kColumn);
  EXPECT_EQ(rule["model.layers.0.self_attn.o_proj.weight"], Shard::kRow);
  EXPECT_EQ(rule["model.layers.0.mlp.up_proj.weight"], Shard::kColumn);
  EXPECT_EQ(rule["model.layers.0.mlp.down_proj.weight"], Shard::kRow);
  EXPECT_EQ(rule["model.layers.1.mlp.shared_experts.gate_proj.weight"], Shard::kColumn);
  EXPECT_EQ(rule["model.layers.1.mlp.experts.2.down_proj.weight"], Shard::kExpert);
  EXPECT_EQ(rule["model.layers.1.mlp.gate.weight"], Shard::kReplicated);
}

// Expert j lives on EP rank floor(j / (E / ep)) (docs/model.md §10.2).
TEST(ShardSpec, ExpertsInContiguousBlocks) {
  ModelConfig m = model_preset("small");
  for (const auto& p : build_param_table(m)) {
    if (p.shard != Shard::kExpert) continue;
    for (int ep : {1, 2, 4, 8, 32})
      for (int e = 0; e < ep; ++e)
        EXPECT_EQ(shard_of(p, 32, 0, 1, e, ep).held, p.expert / (32 / ep) == e);
  }
}

}  // namespace
}  // namespace dstrain::plan
