// Decoder layers -> pipeline stages. Contiguous ranges; the embedding lives on the first
// stage, the final norm, lm_head and any MTP modules on the last (docs/model.md §10.3). With v
// model chunks per pipeline rank (parallel.virtual_stages, the interleaved schedule) there are
// p·v virtual stages; virtual stage s lives on pipeline rank s mod p (Megatron's interleaving).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/train_config.h"

namespace dstrain::plan {

struct StageRange {
  int64_t first_layer = 0;  // decoder layers [first_layer, end_layer)
  int64_t end_layer = 0;
  bool has_embedding = false;
  bool has_head = false;     // final norm + lm_head (+ MTP modules when configured)
  int64_t num_layers() const { return end_layer - first_layer; }
};

// One range per virtual stage: `parallel.stage_layers` when given (p·v counts); otherwise
// uniform, the remainder going to the earliest stages (the last stage already carries the head
// and the loss).
std::vector<StageRange> assign_stages(const config::ModelConfig& m, const config::ParallelConfig& p);

// The virtual stage that holds ParamInfo::layer `layer` (-1: embedding, >= L: MTP or head).
int stage_of_layer(const std::vector<StageRange>& stages, int64_t layer);

}  // namespace dstrain::plan
