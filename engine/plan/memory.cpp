#include "engine/plan/memory.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/common/error.h"
#include "engine/plan/param_table.h"

namespace dstrain::plan {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

MemoryEstimate estimate_memory(int64_t dense, int64_t expert, int64_t dp, int64_t edp,
                               int zero_stage, config::Precision precision, int64_t fp32_read) {
  const bool mixed = precision != config::Precision::kFp32;
  const double held = static_cast<double>(dense + expert);
  const double sharded = static_cast<double>(ceil_div(dense, dp) + ceil_div(expert, edp));
  MemoryEstimate m;
  // Mixed precision holds the 16-bit compute copy, and a widened side copy of the few tensors read
  // in fp32 (docs/design.md §6.10).
  m.weights = mixed ? 2.0 * held + 4.0 * double(fp32_read) : 4.0 * held;
  m.gradients = 4.0 * (zero_stage >= 2 ? sharded : held);
  const double state_per_param = mixed ? 12.0 : 8.0;  // (master +) m + v
  m.optimizer = state_per_param * (zero_stage >= 1 ? sharded : held);
  return m;
}

namespace {

// The buffers of one decoder layer, by placement (engine/model/activations.h): kept whatever the
// mode, in the selective set (bytes, each buffer 64-byte aligned), and the layer's backward
// scratch (floats).
struct LayerFloats {
  int64_t always = 0, selective = 0;          // bytes
  int64_t dyn_always = 0, dyn_selective = 0;  // floats: the expert-parallel receive side (balanced)
  int64_t scratch = 0, ep_backward = 0;       // floats
  // n elements of `bytes` each (4: fp32; the GEMM-only buffers take the compute type's size).
  void take(int64_t n, bool sel = false, int64_t bytes = 4) { (sel ? selective : always) += (n * bytes + 63) / 64 * 64; }
};

int64_t swiglu_scratch(int64_t N, int64_t w, int64_t H) { return N * (3 * w + H) + 64; }

// `rows`: the layer's input rows on this rank (N, or N / tp with sequence parallelism); N: the
// micro-batch's tokens; cb: bytes per element of the compute type, which the buffers only GEMMs
// read are kept in (docs/design.md §6.10).
LayerFloats layer_floats(const config::ModelConfig& m, int64_t index, int64_t N, int64_t rows, int tp, int ep,
                         int64_t cb, bool widen_qkv) {
  LayerFloats f;
  const int64_t H = m.hidden_size, nh = m.num_attention_heads / tp, dn = m.qk_nope_head_dim,
                dr = m.qk_rope_head_dim, dv = m.v_head_dim, dqk = dn + dr, rkv = m.kv_lora_rank;
  const bool lora = m.q_lora_rank.has_value();
  const int64_t rq = m.q_lora_rank.value_or(0);
  // MLA (engine/model/mla.cpp), then the layer's norms and residual sum.
  f.take(N * rq), f.take(lora ? N : 0), f.take(N * rq, true, cb);
  f.take(N * rkv), f.take(N * dr), f.take(N), f.take(N * rkv, true, cb);
  f.take(N * nh * dqk, false, cb), f.take(N * nh * dqk, false, cb), f.take(N * nh * dv, false, cb);
  f.take(N * nh * dv, true), f.take(N * nh, true);
  // (a backend without 16-bit attention for the type also widens Q, K, V there)
  const int64_t attn_scratch = N * (nh * dv * 2 + nh * dqk * 3 + nh * (dn + dv) + dr + 2 * rkv + 2 * rq + (lora ? 0 : H) +
                                    (widen_qkv ? nh * (2 * dqk + dv) : 0)) +
                               16 * 15;
  int64_t ffn_scratch = 0;
  if (m.is_moe_layer(index)) {
    const int64_t E = m.num_routed(), k = m.num_experts_per_tok, I = m.moe_intermediate_size;
    int64_t shared_scratch = 0;
    if (m.num_shared() > 0) {
      const int64_t w = m.num_shared() * I / tp;
      f.take(N * 2 * w), f.take(N * w, true, cb);
      shared_scratch = swiglu_scratch(N, w, H);
    }
    const int64_t n = (N + tp - 1) / tp;  // the most tokens a rank routes
    f.take(n * E), f.take(n * k), f.take(n * E);
    // Xp, GUp, Mp, Yp (the first three only where the experts run here)
    f.take(ep == 1 ? n * k * H : 0, true, cb), f.take(ep == 1 ? n * k * 2 * I : 0), f.take(ep == 1 ? n * k * I : 0, true, cb),
        f.take(n * k * H);
    if (ep > 1) {
      const int64_t recv = expert_receive_rows(n * k);  // balanced, and the margin
      f.dyn_always += recv * H + recv * 2 * I;  // Xr, GUe
      f.dyn_selective += recv * H + recv * I;   // Xe, Me
      // dYr (Yr forward, dXe after), dYe (Ye forward, dXr after), dMe, dGUe; the sent rows Xs
      f.ep_backward = recv * (2 * H + 3 * I) + n * k * H;
    }
    ffn_scratch = N * k * (2 * H + (ep == 1 ? 3 * I : 0)) + N * (k + 2 * E) + E * H + shared_scratch + 192;
  } else {
    const int64_t w = m.intermediate_size / tp;
    f.take(N * 2 * w), f.take(N * w, true, cb);
    ffn_scratch = swiglu_scratch(N, w, H);
  }
  f.take(rows * H, true), f.take(rows), f.take(rows * H), f.take(rows * H, true), f.take(rows);
  f.scratch = std::max(attn_scratch, ffn_scratch);
  return f;
}

}  // namespace

ActivationMemory instance_activation_memory(const config::ModelConfig& m, const InstanceShape& s) {
  const int tp = s.tp;
  const bool sp = s.sequence_parallel && tp > 1;
  const int64_t B = s.micro_batch, S = s.seq_length, N = B * S, H = m.hidden_size;
  const int64_t rows = sp ? (N + tp - 1) / tp : N;
  const int64_t vb = vocab_block(m.vocab_size, tp);
  const int64_t Vl = std::min<int64_t>(m.vocab_size, vb);  // rank 0's vocabulary rows
  const config::ActivationCheckpointingConfig& ac = s.checkpointing;
  const bool full = ac.granularity == config::CheckpointGranularity::kFull;
  const int64_t recomputing = !ac.enabled ? 0 : ac.num_layers ? *ac.num_layers : s.end_layer - s.first_layer;
  const int64_t cb = s.compute_bytes;
  const bool widen = cb == 2 && !s.native.attention;  // Q, K, V widened for fp32 attention
  // ep_backward: the MoE layers' expert-parallel backward buffers, one set per instance that its
  // layers share (the largest layer's); mtp_dh: the MTP modules' running output gradients.
  int64_t kept = 0, shared = 0, dyn_kept = 0, scratch = 0, ep_backward = 0, mtp_dh = 0;  // kept, shared: bytes
  int64_t dyn_shared_max = 0;
  for (int64_t i = s.first_layer; i < s.end_layer; ++i) {
    const LayerFloats f = layer_floats(m, i, N, rows, tp, s.ep, cb, widen);
    scratch = std::max(scratch, f.scratch);
    ep_backward = std::max(ep_backward, f.ep_backward);
    if (i - s.first_layer >= recomputing) {
      kept += f.always + f.selective, dyn_kept += f.dyn_always + f.dyn_selective;
    } else if (full) {
      shared = std::max(shared, f.always + f.selective);
      dyn_shared_max = std::max(dyn_shared_max, f.dyn_always + f.dyn_selective);
    } else {
      kept += f.always, dyn_kept += f.dyn_always;
      shared = std::max(shared, f.selective);
      dyn_shared_max = std::max(dyn_shared_max, f.dyn_selective);
    }
  }
  int64_t model = 3 * N + (s.end_layer - s.first_layer + 1) * rows * H;  // token ids, hidden states
  const int64_t chunk = s.has_head ? loss_chunk_rows(N, H, Vl, s.loss_chunk_tokens) : 0;  // the head's logits: one chunk's
  if (s.has_head) {
    model += rows * H + (sp ? N * H : 0) + rows;  // final norm, its gather
    for (int64_t k = 1; k <= m.num_nextn_predict_layers; ++k) {  // MTP modules: their own buffers and layer
      const int64_t r = B * (S - k);
      model += 10 * r * H + 3 * r;  // (the head's input gradient among them)
      const LayerFloats f = layer_floats(m, m.num_hidden_layers + k - 1, r, r, tp, s.ep, cb, widen);
      kept += f.always + f.selective, dyn_kept += f.dyn_always + f.dyn_selective;
      ep_backward = std::max(ep_backward, f.ep_backward);
      mtp_dh += r * H;
      scratch = std::max({scratch, layer_floats(m, m.num_hidden_layers + k - 1, N, N, tp, s.ep, cb, widen).scratch, 2 * N * H + 64});
    }
  }
  // Backward temporaries (engine/model/deepseek_model.cpp): scratch, dz, dh, two [N,H] buffers,
  // ones, per-row losses and one chunk's logits (last stage), the sequence-parallel gathers.
  // The instance's own (dz on the last stage, dh, ones, the MTP modules' gradients) and what a
  // rank's instances share (model::InstanceWorkspace).
  // (dh is shared on the first stage, which sends no input gradient)
  const int64_t own = (s.has_head ? N * H : 0) + (s.has_embedding ? 0 : rows * H) + N + mtp_dh;
  const int64_t shared_work = scratch + 2 * N * H + (s.has_head ? N + chunk * Vl : 0) + (sp ? 3 * N * H : 0) +
                              ep_backward + (s.has_embedding ? rows * H : 0);
  const int64_t work = own + shared_work;
  // Under bf16 / fp16 the GEMMs' conversion workspaces (engine/model/layer_env.h, ComputeCast),
  // each as large as the largest input it converted (balanced routing for the experts' rows):
  // slot 0 a GEMM input or output gradient, slot 1 a weight-gradient GEMM's input, slot 2 an
  // input several GEMMs share or the attention's output gradient.
  int64_t cast = 0;
  if (s.compute_bytes == 2) {
    const int64_t nh = m.num_attention_heads / tp, dn = m.qk_nope_head_dim, dv = m.v_head_dim,
                  dqk = dn + m.qk_rope_head_dim, rq = m.q_lora_rank.value_or(0), rkv = m.kv_lora_rank;
    const int64_t w = m.intermediate_size / tp, ws = m.num_shared() * m.moe_intermediate_size / tp;
    const int64_t nk = (N + tp - 1) / tp * m.num_experts_per_tok, I = m.moe_intermediate_size;
    const bool moe = m.num_routed() > 0;
    // The saved 16-bit inputs — normed latents, SwiGLU outputs, dispatched rows — need no slot.
    const int64_t slot0 = std::max({N * nh * dqk, N * nh * (dn + dv), N * H, N * rq, N * rkv + N * m.qk_rope_head_dim,
                                    N * 2 * w, N * 2 * ws, moe ? nk * 2 * I : 0, moe ? nk * H : 0,
                                    chunk * Vl});
    const bool ep_rows = moe && s.ep > 1;  // the received rows are fp32
    const int64_t slot1 = std::max({N * H, N * nh * dv, ep_rows ? nk * I : 0, ep_rows ? nk * H : 0,
                                    s.has_head && m.num_nextn_predict_layers > 0 ? N * 2 * H : 0});
    const int64_t slot2 = std::max(N * H, N * nh * dv);
    cast = slot0 + slot1 + slot2;
  }
  ActivationMemory out;
  out.kept = double(kept) + 4.0 * double(dyn_kept + model);
  out.recomputed = double(shared) + 4.0 * double(dyn_shared_max);
  out.workspace = 4.0 * double(work) + double(s.compute_bytes == 2 ? 2 * cast : 0);
  out.workspace_shared = 4.0 * double(shared_work) + double(s.compute_bytes == 2 ? 2 * cast : 0);
  return out;
}

int64_t loss_chunk_rows(int64_t N, int64_t H, int64_t Vl, int64_t requested) {
  DS_CHECK(N > 0 && H > 0 && Vl > 0, "loss chunk of N {} H {} Vl {}", N, H, Vl);
  // Logits as large as the hidden states; raised towards kMinLossChunk rows while a chunk's
  // logits stay within kLossChunkCap floats (1 GiB).
  if (requested <= 0)
    requested = std::max(ceil_div(N * H, Vl), std::min(kMinLossChunk, std::max<int64_t>(1, kLossChunkCap / Vl)));
  return std::min(N, requested);
}

}  // namespace dstrain::plan
