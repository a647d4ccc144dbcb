#include "engine/plan/memory.h"

#include <algorithm>

namespace dstrain::plan {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

MemoryEstimate estimate_memory(int64_t dense, int64_t expert, int64_t dp, int64_t edp,
                               int zero_stage, config::Precision precision) {
  const bool mixed = precision != config::Precision::kFp32;
  const double held = static_cast<double>(dense + expert);
  const double sharded = static_cast<double>(ceil_div(dense, dp) + ceil_div(expert, edp));
  MemoryEstimate m;
  m.weights = (mixed ? 2.0 : 4.0) * held;
  m.gradients = 4.0 * (zero_stage >= 2 ? sharded : held);
  const double state_per_param = mixed ? 12.0 : 8.0;  // (master +) m + v
  m.optimizer = state_per_param * (zero_stage >= 1 ? sharded : held);
  return m;
}

double activation_bytes(const config::ModelConfig& m, int64_t layers, int64_t micro_batch, int64_t seq_length) {
  const double H = double(m.hidden_size), heads = double(m.num_attention_heads);
  const double attn = 3.0 * heads * double(m.qk_head_dim() + m.v_head_dim) + double(m.q_lora_rank.value_or(0)) +
                      double(m.kv_lora_rank + m.qk_rope_head_dim);
  const double moe_width = double(m.num_experts_per_tok + m.num_shared()) * double(m.moe_intermediate_size);
  const double ffn = 3.0 * (m.num_routed() > 0 ? std::max(moe_width, 0.0) : double(m.intermediate_size));
  const double per_token = double(layers) * (4.0 * H + attn + ffn) + double(layers + 1) * H + 2.0 * double(m.vocab_size);
  return 4.0 * per_token * double(micro_batch) * double(seq_length);
}

}  // namespace dstrain::plan
