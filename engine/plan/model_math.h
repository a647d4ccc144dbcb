// Parameter counts and model FLOPs (docs/model.md §8, §9).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/train_config.h"
#include "engine/plan/param_table.h"

namespace dstrain::plan {

struct ParamCounts {
  int64_t total = 0;                     // main model parameters (buffers excluded)
  int64_t activated = 0;                 // per token: k of the E routed experts of each MoE layer
  int64_t activated_excl_embedding = 0;  // DeepSeek's published convention (docs/model.md §11, item 8)
  int64_t mtp_total = 0;                 // MTP modules' own parameters (shared embedding/head not counted)
  int64_t mtp_activated = 0;
  int64_t buffers = 0;                   // e_score_correction_bias elements
};

// Counted from the parameter table itself, so the registry and the published numbers agree.
ParamCounts count_params(const config::ModelConfig& m, const std::vector<ParamInfo>& table);

struct FlopsPerToken {
  double attn_proj = 0;  // one layer's MLA projections
  double attn_core = 0;  // one layer's QK^T and PV at S_ctx = S/2 (causal, Megatron convention)
  double dense = 0;      // one dense SwiGLU layer
  double moe = 0;        // one MoE layer: router + (k + n_shared) experts
  double head = 0;       // lm_head
  double mtp = 0;        // all MTP modules together
  double forward = 0;    // whole model, per token
  double train = 0;      // 3 x forward (backward = 2 x forward)
  double layers_forward = 0;  // the decoder layers' part of forward (what full recomputation repeats)
};

// FLOPs per token executed by a training step with recomputation (docs/design.md §6.7): train
// plus the recomputed forward parts — every recomputing decoder layer's forward (full), or its
// attention core (selective; the rest of the selective set is element-wise). `stages`: the
// pipeline stages (model chunks) the decoder layers are split over.
double train_flops_with_recompute(const FlopsPerToken& f, const config::ModelConfig& m,
                                  const config::ActivationCheckpointingConfig& ac, int64_t stages);

FlopsPerToken flops_per_token(const config::ModelConfig& m, int64_t seq_length);

}  // namespace dstrain::plan
