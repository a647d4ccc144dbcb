// `dstrain CONFIG --dump-grads FILE.h5`: one forward and backward of the model on the first
// global batch, written for comparison with a reference implementation (docs/model.md §12).
#pragma once

#include <string>
#include <vector>

#include "engine/plan/parallel_plan.h"
#include "engine/runtime/rank_engine.h"

namespace dstrain::runtime {

// The first global batch of the configured data (step 0 of the seeded order), [B, S+1].
std::vector<int32_t> first_batch_tokens(const config::TrainConfig& cfg, int64_t B);

// Collective over `groups`, any layout: each data-parallel rank runs its share of the batch in
// one forward; rank 0 assembles the full weights and the summed gradients and writes the file.
// `threads` CPU threads per rank (0: all). The weights are the initial ones, or those of the
// checkpoint that checkpoint.resume names.
void dump_grads(const plan::ParallelPlan& plan, const RankGroups& groups, const std::string& path, int threads);

}  // namespace dstrain::runtime
