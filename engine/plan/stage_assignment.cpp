#include "engine/plan/stage_assignment.h"

#include "engine/common/error.h"

namespace dstrain::plan {

std::vector<StageRange> assign_stages(const config::ModelConfig& m,
                                      const config::ParallelConfig& p) {
  const int64_t S = p.pipeline * p.virtual_stages, L = m.num_hidden_layers;
  DS_CHECK(S >= 1 && S <= L, "{} stages for {} layers", S, L);
  std::vector<int64_t> counts = p.stage_layers;
  if (counts.empty()) {
    counts.assign(S, L / S);
    for (int64_t s = 0; s < L % S; ++s) ++counts[s];
  }
  DS_CHECK(static_cast<int64_t>(counts.size()) == S, "stage_layers size");
  std::vector<StageRange> stages(S);
  int64_t next = 0;
  for (int64_t s = 0; s < S; ++s) {
    stages[s].first_layer = next;
    next += counts[s];
    stages[s].end_layer = next;
  }
  DS_CHECK(next == L, "stage layers sum to {} not {}", next, L);
  stages.front().has_embedding = true;
  stages.back().has_head = true;
  return stages;
}

int stage_of_layer(const std::vector<StageRange>& stages, int64_t layer) {
  if (layer < 0) return 0;
  for (size_t s = 0; s < stages.size(); ++s)
    if (layer < stages[s].end_layer) return static_cast<int>(s);
  return static_cast<int>(stages.size()) - 1;  // MTP modules and the head
}

}  // namespace dstrain::plan
