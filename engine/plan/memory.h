// Per-rank memory of weights, gradients and optimizer state, by ZeRO stage and precision.
//
// Model of dstrain's storage (docs/design.md §2.7):
//   fp32:       weights 4 B/param (they are the master copy), gradients 4 B, AdamW m and v 8 B.
//   bf16/fp16:  compute copy of the weights 2 B, fp32 master 4 B, fp32 gradients 4 B (micro-
//               batches accumulate in fp32), AdamW m and v 8 B.
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
  double total() const { return weights + gradients + optimizer; }
};

// `dense` / `expert`: parameters this rank holds; `dp` / `edp`: the groups they shard over.
MemoryEstimate estimate_memory(int64_t dense, int64_t expert, int64_t dp, int64_t edp,
                               int zero_stage, config::Precision precision);

// Bytes of activations a rank keeps from one micro-batch's forward for its backward (fp32): per
// token, the hidden state between layers, each layer's normed inputs, MLA's query / key / value
// and output and latent vectors, the SwiGLU (or activated experts') intermediates, and the
// logits. An estimate within 30% of what the model keeps (tests/model/test_params.cpp; docs/design.md §7.4), used
// to refuse a run that cannot fit before anything is allocated. `layers`: the decoder layers on
// the rank (MTP modules count as layers).
// With tensor parallelism `tp`, the parts split by heads, widths, vocabulary rows or (the routed
// experts) tokens count 1/tp; with sequence parallelism the norm and residual regions too.
double activation_bytes(const config::ModelConfig& m, int64_t layers, int64_t micro_batch, int64_t seq_length,
                        int tp = 1, bool sequence_parallel = false);

}  // namespace dstrain::plan
