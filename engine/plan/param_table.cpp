#include "engine/plan/param_table.h"

#include <fmt/format.h>

#include "engine/common/error.h"

namespace dstrain::plan {

const char* shard_name(Shard s) {
  switch (s) {
    case Shard::kReplicated: return "replicated";
    case Shard::kColumn: return "column(tp)";
    case Shard::kRow: return "row(tp)";
    case Shard::kVocab: return "vocab(tp)";
    case Shard::kExpert: return "expert(ep)";
  }
  return "?";
}

int64_t ParamInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t ShardSpec::local_numel() const {
  if (!held) return 0;
  int64_t n = 1;
  for (int64_t d : local_shape) n *= d;
  return n;
}

int64_t head_layer_index(const config::ModelConfig& m) {
  return m.num_hidden_layers + m.num_nextn_predict_layers;
}

namespace {

class TableBuilder {
 public:
  explicit TableBuilder(const config::ModelConfig& m) : m_(m) {}

  void add(std::string name, std::vector<int64_t> shape, int64_t layer, Shard shard,
           int64_t expert = -1, bool buffer = false) {
    ParamInfo p;
    p.name = std::move(name);
    p.weight_decay = !buffer && shape.size() >= 2;
    p.shape = std::move(shape);
    p.layer = layer;
    p.shard = shard;
    p.expert = expert;
    p.buffer = buffer;
    table_.push_back(std::move(p));
  }

  // A SwiGLU block (dense MLP, shared experts or one routed expert) of width `width`.
  void swiglu(const std::string& prefix, int64_t width, int64_t layer, bool expert_block,
              int64_t expert = -1) {
    const int64_t H = m_.hidden_size;
    const Shard col = expert_block ? Shard::kExpert : Shard::kColumn;
    const Shard row = expert_block ? Shard::kExpert : Shard::kRow;
    add(prefix + "gate_proj.weight", {width, H}, layer, col, expert);
    add(prefix + "up_proj.weight", {width, H}, layer, col, expert);
    add(prefix + "down_proj.weight", {H, width}, layer, row, expert);
  }

  void attention(const std::string& prefix, int64_t layer) {
    const int64_t H = m_.hidden_size, nh = m_.num_attention_heads;
    const std::string a = prefix + "self_attn.";
    if (m_.q_lora_rank) {
      const int64_t rq = *m_.q_lora_rank;
      add(a + "q_a_proj.weight", {rq, H}, layer, Shard::kReplicated);
      if (m_.attention_bias) add(a + "q_a_proj.bias", {rq}, layer, Shard::kReplicated);
      add(a + "q_a_layernorm.weight", {rq}, layer, Shard::kReplicated);
      add(a + "q_b_proj.weight", {nh * m_.qk_head_dim(), rq}, layer, Shard::kColumn);
    } else {
      add(a + "q_proj.weight", {nh * m_.qk_head_dim(), H}, layer, Shard::kColumn);
    }
    const int64_t kv_a = m_.kv_lora_rank + m_.qk_rope_head_dim;
    add(a + "kv_a_proj_with_mqa.weight", {kv_a, H}, layer, Shard::kReplicated);
    if (m_.attention_bias) add(a + "kv_a_proj_with_mqa.bias", {kv_a}, layer, Shard::kReplicated);
    add(a + "kv_a_layernorm.weight", {m_.kv_lora_rank}, layer, Shard::kReplicated);
    add(a + "kv_b_proj.weight", {nh * (m_.qk_nope_head_dim + m_.v_head_dim), m_.kv_lora_rank},
        layer, Shard::kColumn);
    add(a + "o_proj.weight", {H, nh * m_.v_head_dim}, layer, Shard::kRow);
    if (m_.attention_bias) add(a + "o_proj.bias", {H}, layer, Shard::kReplicated);
  }

  void decoder_layer(int64_t i) {
    const int64_t H = m_.hidden_size;
    const std::string p = fmt::format("model.layers.{}.", i);
    add(p + "input_layernorm.weight", {H}, i, Shard::kReplicated);
    attention(p, i);
    add(p + "post_attention_layernorm.weight", {H}, i, Shard::kReplicated);
    if (!m_.is_moe_layer(i)) {
      swiglu(p + "mlp.", m_.intermediate_size, i, false);
      return;
    }
    const int64_t E = m_.num_routed();
    add(p + "mlp.gate.weight", {E, H}, i, Shard::kReplicated);
    if (m_.model_type == config::ModelType::kDeepseekV3)
      add(p + "mlp.gate.e_score_correction_bias", {E}, i, Shard::kReplicated, -1, true);
    for (int64_t e = 0; e < E; ++e)
      swiglu(fmt::format("{}mlp.experts.{}.", p, e), m_.moe_intermediate_size, i, true, e);
    if (m_.num_shared() > 0)
      swiglu(p + "mlp.shared_experts.", m_.num_shared() * m_.moe_intermediate_size, i, false);
  }

  // MTP module k (docs/model.md §3.8) at layer index L + k - 1: its own norms and projection, one
  // decoder layer; embedding and lm_head are shared with the main model.
  void mtp_module(int64_t index) {
    const int64_t H = m_.hidden_size;
    const std::string p = fmt::format("model.layers.{}.", index);
    add(p + "enorm.weight", {H}, index, Shard::kReplicated);
    add(p + "hnorm.weight", {H}, index, Shard::kReplicated);
    add(p + "eh_proj.weight", {H, 2 * H}, index, Shard::kReplicated);
    decoder_layer(index);
    add(p + "shared_head.norm.weight", {H}, index, Shard::kReplicated);
  }

  std::vector<ParamInfo> build() {
    const int64_t V = m_.vocab_size, H = m_.hidden_size, L = m_.num_hidden_layers;
    add("model.embed_tokens.weight", {V, H}, -1, Shard::kVocab);
    for (int64_t i = 0; i < L; ++i) decoder_layer(i);
    for (int64_t k = 0; k < m_.num_nextn_predict_layers; ++k) mtp_module(L + k);
    const int64_t head = head_layer_index(m_);
    add("model.norm.weight", {H}, head, Shard::kReplicated);
    add("lm_head.weight", {V, H}, head, Shard::kVocab);
    return std::move(table_);
  }

 private:
  const config::ModelConfig& m_;
  std::vector<ParamInfo> table_;
};

}  // namespace

bool read_in_fp32(const ParamInfo& p) {
  if (p.buffer || p.shard == Shard::kExpert) return false;
  static const std::string router = ".mlp.gate.weight";
  const std::string& n = p.name;
  return p.shape.size() == 1 ||
         (n.size() >= router.size() && n.compare(n.size() - router.size(), router.size(), router) == 0);
}

std::vector<ParamInfo> build_param_table(const config::ModelConfig& m) {
  return TableBuilder(m).build();
}

int64_t vocab_block(int64_t vocab_size, int tp_size) { return (vocab_size + tp_size - 1) / tp_size; }

ShardSpec shard_of(const ParamInfo& p, int64_t num_experts, int tp, int tp_size, int ep,
                   int ep_size) {
  ShardSpec s;
  s.offset.assign(p.shape.size(), 0);
  s.local_shape = p.shape;
  switch (p.shard) {
    case Shard::kReplicated:
      break;
    case Shard::kVocab: {
      // Vocabulary rows in blocks of ceil(V / tp): a vocabulary that tp does not divide is padded
      // at the end (Megatron's rule); the padding rows exist nowhere — the last ranks hold fewer
      // real rows (possibly none), and the model treats the missing ones as absent logits.
      const int64_t block = vocab_block(p.shape[0], tp_size);
      s.offset[0] = std::min(p.shape[0], tp * block);
      s.local_shape[0] = std::min(p.shape[0], (tp + 1) * block) - s.offset[0];
      break;
    }
    case Shard::kColumn:
    case Shard::kRow: {
      const size_t dim = p.shard == Shard::kRow ? 1 : 0;
      DS_CHECK(p.shape[dim] % tp_size == 0, "{} dim {} = {} not divisible by tp {}", p.name, dim,
               p.shape[dim], tp_size);
      s.local_shape[dim] = p.shape[dim] / tp_size;
      s.offset[dim] = tp * s.local_shape[dim];
      break;
    }
    case Shard::kExpert: {
      const int64_t per_rank = num_experts / ep_size;
      s.held = p.expert / per_rank == ep;
      break;
    }
  }
  return s;
}

}  // namespace dstrain::plan
