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

double activation_bytes(const config::ModelConfig& m, int64_t layers, int64_t micro_batch, int64_t seq_length,
                        int tp, bool sequence_parallel) {
  const double H = double(m.hidden_size), heads = double(m.num_attention_heads), t = double(tp);
  // Split by heads over the tensor-parallel ranks: queries, keys, values, outputs.
  const double attn_heads = 3.0 * heads * double(m.qk_head_dim() + m.v_head_dim) / t;
  // Replicated: the low-rank latents every rank keeps whole.
  const double attn_latent = double(m.q_lora_rank.value_or(0)) + double(m.kv_lora_rank + m.qk_rope_head_dim);
  // Split either way: dense and shared widths by columns, the routed experts by tokens.
  const double moe_width = double(m.num_experts_per_tok + m.num_shared()) * double(m.moe_intermediate_size);
  const double ffn = 3.0 * (m.num_routed() > 0 ? moe_width : double(m.intermediate_size)) / t;
  // The norm and residual regions: split by tokens with sequence parallelism.
  const double residual = (4.0 * double(layers) + double(layers + 1)) * H / (sequence_parallel ? t : 1.0);
  const double per_token = double(layers) * (attn_heads + attn_latent + ffn) + residual + 2.0 * double(m.vocab_size) / t;
  return 4.0 * per_token * double(micro_batch) * double(seq_length);
}

}  // namespace dstrain::plan
