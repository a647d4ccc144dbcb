// make_plan: (config, world size) -> everything the engine needs to lay the model out over the
// ranks. Pure: no MPI, no allocation beyond the tables, so a 2048-rank DeepSeek-V3 layout can be
// checked on a laptop (`dstrain CONFIG --dry-run --world-size 2048`).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/train_config.h"
#include "engine/plan/batch_plan.h"
#include "engine/plan/memory.h"
#include "engine/plan/model_math.h"
#include "engine/plan/param_table.h"
#include "engine/plan/rank_grid.h"
#include "engine/plan/stage_assignment.h"

namespace dstrain::plan {

// What one rank of a pipeline stage holds. All ranks of a stage hold the same amounts (TP and
// EP split evenly), so one entry per stage describes every rank.
struct StageLoad {
  int64_t dense_params = 0;   // this rank's slice of non-expert parameters
  int64_t expert_params = 0;  // this rank's routed experts
  int64_t buffers = 0;
  int64_t params() const { return dense_params + expert_params; }
};

struct ParallelPlan {
  config::TrainConfig config;  // resolved: parallel.data and the batch triangle filled in
  Degrees degrees;
  RankGrid grid{Degrees{}};
  BatchPlan batch;
  std::vector<StageRange> stages;
  std::vector<ParamInfo> params;  // stage of params[i] is param_stage[i]
  std::vector<int> param_stage;
  std::vector<StageLoad> stage_loads;
  ParamCounts counts;
  FlopsPerToken flops;

  int stage_of_rank(int rank) const { return grid.coord(rank).pp; }
  ShardSpec shard(size_t param_index, int rank) const;
  MemoryEstimate memory(int stage, int zero_stage, config::Precision precision) const;
};

// The most parameter tensors a plan's registry may hold.
inline constexpr int64_t kMaxRegistryEntries = 10'000'000;

// Throws ConfigError when the config does not fit `world_size` (degrees, batch triangle), or the
// model has more than kMaxRegistryEntries tensors.
ParallelPlan make_plan(const config::TrainConfig& cfg, int world_size);

}  // namespace dstrain::plan
