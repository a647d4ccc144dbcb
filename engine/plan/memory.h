// Per-rank memory of weights, gradients and optimizer state, by ZeRO stage and precision.
//
// Model of dstrain's storage (docs/design.md §2.7):
//   fp32:       weights 4 B/param (they are the master copy), gradients 4 B, AdamW m and v 8 B.
//   bf16/fp16:  compute copy of the weights 2 B, fp32 master 4 B, fp32 gradients 4 B (micro-
//               batches accumulate in fp32), AdamW m and v 8 B: 18 B at ZeRO-0. No fp32 copy of
//               the compute weights: only the small tensors read in fp32 (norms, biases, the
//               router) keep a widened side copy, 4 B each.
//   ZeRO-1 shards the optimizer state (master + m + v) over the data-parallel group; ZeRO-2 also
//   the gradients. Dense parameters shard over DP, expert parameters over expert-DP.
#pragma once

#include <cstdint>

#include "engine/config/train_config.h"

namespace dstrain::plan {

struct MemoryEstimate {
  double weights = 0;    // bytes of the working weights (compute dtype)
  double gradients = 0;  // bytes of gradients held after reduction
  double optimizer = 0;  // bytes of fp32 master (mixed precision) + AdamW moments
  double compression = 0;  // bytes of PowerSGD's error feedback, Q and staging (gradient_compression)
  double total() const { return weights + gradients + optimizer + compression; }
};

// `dense` / `expert`: parameters this rank holds; `dp` / `edp`: the groups they shard over.
// `fp32_read`: elements of the parameters read in fp32, which mixed precision keeps a widened
// side copy of (plan::read_in_fp32).
// The rows an expert-parallel rank's receive buffers hold from the start, for `balanced` rows
// (balanced routing: as many rows received as sent): an eighth more, for the imbalance of real
// routing (docs/design.md §6.7). A step that receives more grows them once, to a quarter more
// than it received (model/ffn.cpp), and logs it; the plan counts this size.
inline int64_t expert_receive_rows(int64_t balanced) { return balanced + balanced / 8; }

MemoryEstimate estimate_memory(int64_t dense, int64_t expert, int64_t dp, int64_t edp,
                               int zero_stage, config::Precision precision, int64_t fp32_read = 0);

// Activation memory of one model instance — one micro-batch of one (virtual) pipeline stage on
// one rank — computed from the buffers the model allocates (docs/design.md §6.7), so that a run
// that cannot fit is refused before anything is allocated and --dry-run shows what checkpointing
// saves. fp32 storage, and the compute type for the buffers only GEMMs read under bf16 / fp16;
// expert-parallel receive buffers at expert_receive_rows (balanced routing and a margin).
struct ActivationMemory {
  double kept = 0;        // saved buffers alive from forward to backward (hidden states, head, MTP)
  double recomputed = 0;  // the recomputing layers' shared buffers (the largest layer's)
  double workspace = 0;   // backward temporaries and the expert-parallel backward buffers
  // Of the workspace, what the instances of a rank share (model::InstanceWorkspace: the scratch
  // arena, conversions, work buffers, logits chunk, expert-parallel backward buffers); the rest
  // is each instance's own (the head's and the input's gradients, the bias ones).
  double workspace_shared = 0;
  double saved() const { return kept + recomputed; }
  double total() const { return saved() + workspace; }
  ActivationMemory& operator+=(const ActivationMemory& o) {
    kept += o.kept, recomputed += o.recomputed, workspace += o.workspace, workspace_shared += o.workspace_shared;
    return *this;
  }
  ActivationMemory operator*(double f) const {
    return {kept * f, recomputed * f, workspace * f, workspace_shared * f};
  }
};

// Under bf16 / fp16, whether the backend's attention core runs on 16-bit inputs (docs/design.md
// §6.10, Backend::low_precision_attention); where it does not, Q, K and V are widened into fp32
// copies in the model's buffers. Assumed where no backend is at hand (the dry run). (The GEMMs
// always take 16-bit operands: a backend whose 16-bit GEMMs are not native widens inside them.)
struct Native16 {
  bool attention = true;
};

struct InstanceShape {
  int64_t first_layer = 0, end_layer = 0;  // decoder layers [first, end)
  bool has_embedding = true, has_head = true;
  int64_t micro_batch = 1, seq_length = 1;
  int tp = 1, ep = 1;
  bool sequence_parallel = false;  // only with tp > 1
  config::ActivationCheckpointingConfig checkpointing;
  int64_t compute_bytes = 4;  // 2 under bf16 / fp16: the GEMMs' conversion workspaces join the workspace
  Native16 native;  // under bf16 / fp16: whether the attention takes 16-bit inputs
  int64_t loss_chunk_tokens = 0;  // kernels.loss_chunk_tokens (0: loss_chunk_rows' automatic size)
};

ActivationMemory instance_activation_memory(const config::ModelConfig& m, const InstanceShape& s);

// Token rows per chunk of the LM head and its cross-entropy (docs/design.md §6.13): a model
// instance holds the logits of one chunk at a time, [chunk, Vl] in fp32, never those of all N
// tokens. `requested` > 0 (kernels.loss_chunk_tokens) asks for that many rows; 0 the automatic
// size: as many rows as make the chunk's logits as large as the [N, H] hidden states, and at
// least kMinLossChunk rows (so the weight-gradient GEMM, which writes all of dW_lm once per
// chunk, keeps a long reduction) unless their logits would pass kLossChunkCap floats. Never
// more than N.
inline constexpr int64_t kMinLossChunk = 2048;
inline constexpr int64_t kLossChunkCap = int64_t(1) << 28;  // floats: 1 GiB of fp32 logits
int64_t loss_chunk_rows(int64_t N, int64_t H, int64_t Vl, int64_t requested = 0);

}  // namespace dstrain::plan
