#include "engine/plan/model_math.h"

#include <algorithm>

namespace dstrain::plan {

ParamCounts count_params(const config::ModelConfig& m, const std::vector<ParamInfo>& table) {
  ParamCounts c;
  const int64_t L = m.num_hidden_layers;
  for (const ParamInfo& p : table) {
    if (p.buffer) {
      c.buffers += p.numel();
      continue;
    }
    const bool mtp = p.layer >= L && p.layer < head_layer_index(m);
    const bool active = p.shard != Shard::kExpert || p.expert < m.num_experts_per_tok;
    int64_t& total = mtp ? c.mtp_total : c.total;
    int64_t& activated = mtp ? c.mtp_activated : c.activated;
    total += p.numel();
    if (active) activated += p.numel();
    if (!mtp && active && p.name != "model.embed_tokens.weight")
      c.activated_excl_embedding += p.numel();
  }
  return c;
}

FlopsPerToken flops_per_token(const config::ModelConfig& m, int64_t seq_length) {
  FlopsPerToken f;
  const double H = m.hidden_size, nh = m.num_attention_heads, dn = m.qk_nope_head_dim,
               dr = m.qk_rope_head_dim, dv = m.v_head_dim, rkv = m.kv_lora_rank;
  const double dqk = dn + dr;
  f.attn_proj = m.q_lora_rank ? 2.0 * (H * *m.q_lora_rank + *m.q_lora_rank * nh * dqk)
                              : 2.0 * H * nh * dqk;
  f.attn_proj += 2.0 * H * (rkv + dr) + 2.0 * rkv * nh * (dn + dv) + 2.0 * nh * dv * H;
  f.attn_core = 2.0 * nh * (dqk + dv) * (static_cast<double>(seq_length) / 2.0);
  f.dense = 6.0 * H * m.intermediate_size;
  f.moe = 2.0 * H * m.num_routed() +
          6.0 * H * m.moe_intermediate_size * (m.num_experts_per_tok + m.num_shared());
  f.head = 2.0 * H * m.vocab_size;
  const auto layer = [&](int64_t i) {
    return f.attn_proj + f.attn_core + (m.is_moe_layer(i) ? f.moe : f.dense);
  };
  double body = 0;
  for (int64_t i = 0; i < m.num_hidden_layers; ++i) body += layer(i);
  for (int64_t k = 0; k < m.num_nextn_predict_layers; ++k)
    f.mtp += layer(m.num_hidden_layers + k) + 4.0 * H * H + f.head;
  f.forward = body + f.head + f.mtp;
  f.train = 3.0 * f.forward;
  f.layers_forward = body;
  return f;
}

double train_flops_with_recompute(const FlopsPerToken& f, const config::ModelConfig& m,
                                  const config::ActivationCheckpointingConfig& ac, int64_t stages) {
  if (!ac.enabled || m.num_hidden_layers == 0) return f.train;
  const double L = double(m.num_hidden_layers);
  const double share = ac.num_layers ? std::min(1.0, double(*ac.num_layers) * double(stages) / L) : 1.0;
  const double again = ac.granularity == config::CheckpointGranularity::kFull ? f.layers_forward : L * f.attn_core;
  return f.train + share * again;
}

}  // namespace dstrain::plan
