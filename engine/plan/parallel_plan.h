// make_plan: (config, world size) -> everything the engine needs to lay the model out over the
// ranks. Pure: no MPI, no allocation beyond the tables, so a 2048-rank DeepSeek-V3 layout can be
// checked on a laptop (`dstrain CONFIG --dry-run --world-size 2048`).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "engine/config/train_config.h"
#include "engine/plan/batch_plan.h"
#include "engine/plan/memory.h"
#include "engine/plan/model_math.h"
#include "engine/plan/param_table.h"
#include "engine/plan/pipeline_schedule.h"
#include "engine/plan/powersgd_layout.h"
#include "engine/plan/rank_grid.h"
#include "engine/plan/stage_assignment.h"

namespace dstrain::plan {

// What one rank of a pipeline stage holds. All ranks of a stage hold the same amounts (TP and
// EP split evenly), so one entry per stage describes every rank.
struct StageLoad {
  int64_t dense_params = 0;   // this rank's slice of non-expert parameters
  int64_t expert_params = 0;  // this rank's routed experts
  int64_t buffers = 0;
  int64_t fp32_read = 0;      // elements of the parameters read in fp32 (plan::read_in_fp32), 16-aligned each
  int64_t params() const { return dense_params + expert_params; }
};

struct ParallelPlan {
  config::TrainConfig config;  // resolved: parallel.data and the batch triangle filled in
  Degrees degrees;
  RankGrid grid{Degrees{}};
  BatchPlan batch;
  std::vector<StageRange> stages;  // per virtual stage (p·v; v = parallel.virtual_stages)
  std::vector<ParamInfo> params;   // params[i] is held by pipeline rank param_stage[i]
  std::vector<int> param_stage;
  std::vector<StageLoad> stage_loads;  // per pipeline rank
  ParamCounts counts;
  FlopsPerToken flops;
  // The pipeline schedule of a step (docs/design.md §6.6): gradient_accumulation_steps
  // micro-batches over p ranks and v chunks, and its simulation at unit costs (F = B = W). Empty
  // without pipeline parallelism (and for more than 2^20 ops).
  PipelineSchedule schedule;
  ScheduleStats schedule_stats;
  // Micro-batch chunks pipeline rank `pp` holds activations for at once (the simulated peak; the
  // whole step's without a simulation).
  int in_flight(int pp) const {
    if (size_t(pp) < schedule_stats.peak_in_flight.size()) return schedule_stats.peak_in_flight[size_t(pp)];
    return degrees.pp > 1 ? int(batch.accumulation) * chunks() : 1;
  }

  // Model instances chunk `chunk` of pipeline rank `pp` builds: the most micro-batches of that
  // chunk between their forward and their last backward op in the rank's list (the runtime
  // acquires an instance at F and releases it after B or W), at least 1.
  int chunk_in_flight(int pp, int chunk) const;

  int stage_of_rank(int rank) const { return grid.coord(rank).pp; }
  int chunks() const { return int(config.parallel.virtual_stages); }
  // The virtual stages pipeline rank `pp` holds, in chunk order: pp, pp + p, …
  std::vector<int> virtual_stages_of(int pp) const {
    std::vector<int> out;
    for (int c = 0; c < chunks(); ++c) out.push_back(c * degrees.pp + pp);
    return out;
  }
  // Decoder layers on pipeline rank `pp`, MTP modules included.
  int64_t layers_of(int pp) const {
    int64_t n = 0;
    for (int s : virtual_stages_of(pp))
      n += stages[size_t(s)].num_layers() + (stages[size_t(s)].has_head ? config.model.num_nextn_predict_layers : 0);
    return n;
  }
  // Activation memory of one model instance of a virtual stage (one micro-batch; 0: the plan's
  // micro-batch), and of pipeline rank `pp` with the schedule's peak in flight.
  // `native`: under bf16 / fp16, whether the backend runs its GEMMs and its attention on 16-bit
  // inputs (else the model widens their inputs to fp32 in its workspaces, docs/design.md §6.10);
  // both assumed where no backend is at hand.
  ActivationMemory instance_activations(int virtual_stage, int64_t micro_batch = 0, Native16 native = {}) const;
  ActivationMemory activations(int pp, int64_t micro_batch = 0, Native16 native = {}) const;
  ShardSpec shard(size_t param_index, int rank) const;
  // At ZeRO-2 the gradients are the shard, plus — holding one — gradient_window(stage) elements,
  // or the whole buffer where no shard is held (below). With gradient_compression, `compression`
  // is PowerSGD's memory: the error feedback (one fp32 gradient of each compressed buffer), Q and
  // the staging of the whole part and P.
  MemoryEstimate memory(int stage, int zero_stage, config::Precision precision) const;
  // Whether `zero_stage` would hold only a gradient shard between reductions (docs/design.md
  // §6.5; parallel::GradSync's hold_shard): ZeRO-2 reducing every micro-batch as its backward
  // pass finishes — no pipeline parallelism, overlap_comm on — with the gradients in host memory
  // (a device keeps its whole buffer). Else ZeRO-2 reduce-scatters at the step's end from the
  // whole buffer.
  bool holds_gradient_shard(int zero_stage) const;
  // Gradient elements beyond its shard a rank holding one may hold at once: the largest set of
  // gradients final together (a layer; the head with the MTP modules; the embedding), a bucket
  // being filled and kGradShardFlights buckets in flight — at most the rest of the buffers.
  int64_t gradient_window(int stage) const;
  bool gradients_in_device_memory = false;  // set where the device is resolved (a GPU backend)
  // With gradient_compression: PowerSGD's split of world rank `rank`'s dense and routed-expert
  // gradient buffers (as parallel::GradSync makes it from the parameter store), each empty where
  // its group has one rank or the buffer no elements; both empty without compression.
  std::array<PowerSgdLayout, 2> powersgd_layouts(int rank) const;
  // Bytes pipeline rank `pp` needs: state at the configured ZeRO stage and precision, plus its
  // activations with the schedule's peak in flight.
  double rank_need(int pp) const;

  // How train_micro_batch_size_per_gpu: auto chose (absent when it was given).
  struct AutoMicroBatch {
    int64_t chosen = 0;
    double need = 0, budget = 0;
    int64_t larger = 0;  // the next larger candidate, which did not fit (0: none)
    double larger_need = 0;
  };
  std::optional<AutoMicroBatch> auto_micro;
};

// Gradient buckets a rank holding a ZeRO-2 shard lets be in flight at once.
inline constexpr int kGradShardFlights = 4;

// The most parameter tensors a plan's registry may hold.
inline constexpr int64_t kMaxRegistryEntries = 10'000'000;

// Throws ConfigError when the config does not fit `world_size` (degrees, batch triangle), or the
// model has more than kMaxRegistryEntries tensors. `host_share_bytes`: the memory budget per rank
// for train_micro_batch_size_per_gpu: auto when memory_budget_gib is null (the caller's share of
// this host's available memory).
ParallelPlan make_plan(const config::TrainConfig& cfg, int world_size, double host_share_bytes = 0);

}  // namespace dstrain::plan
