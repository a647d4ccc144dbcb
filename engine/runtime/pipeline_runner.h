// The pipeline executor (docs/design.md §6.6): interprets this rank's instruction list of the
// plan's schedule (engine/plan/pipeline_schedule.h) — nothing else decides the order of the
// forward, backward, weight-gradient, send and receive operations of a step. Used for every
// layout: without pipeline parallelism the list is F0 B0 F1 B1 … on one chunk.
//
// Model instances: the rank's chunks (virtual stages c·p + r) are DeepSeekModel instances built
// for their layers (model::StageSpec) and sharing the rank's ParamStore. A micro-batch in flight
// on a chunk holds one instance (its activations) from its F to its last backward op; instances
// return to their chunk's pool then, so a chunk keeps as many as the schedule has micro-batches
// in flight on it (the simulator's peak), reused by liveness.
//
// Communication: activations and gradients cross stages over the pipeline group, non-blocking,
// on two communicators (one per direction of the data, so an activation and a gradient between
// the same two ranks never match each other's receive). Each receive is posted when the compute
// op before the one that needs it starts; sends are copied out and complete in the background.
// With MTP modules on the last stage, that stage keeps a mirror of the first stage's embedding
// shard: its weights arrive at the start of each step, its gradient is added to the first
// stage's before that gradient is declared final (Megatron's embedding group).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/communicator.h"
#include "engine/model/deepseek_model.h"
#include "engine/model/param_store.h"
#include "engine/plan/parallel_plan.h"

namespace dstrain::runtime {

class RankGroups;

struct PipelineStepResult {
  // This rank's part: CE and MTP on the last stage, the balance loss of its MoE layers; summed
  // over the micro-batches.
  model::Losses loss;
  double forward_s = 0, backward_s = 0, weight_s = 0;  // compute time per op kind (W: zero-bubble)
  double wait_s = 0;   // waiting for activations, gradients and the embedding's mirror
  double busy_s = 0;   // every compute op together
  double comm_wait_s = 0;  // finishing the data-parallel reduction (after the last backward; ZeRO-2: each)
  double span_s = 0;   // from the step's start to the end of its last compute op
  int64_t forwards = 0, backwards = 0, weights = 0;
};

class PipelineRunner final : public model::BackwardObserver {
 public:
  // Builds this rank's chunks for `micro_batch` sequences per forward and the plan's schedule
  // kind over `micro_batches` micro-batches. Collective over the pipeline group.
  PipelineRunner(const plan::ParallelPlan& plan, const RankGroups& groups, kernels::Backend& be,
                 model::Collectives& coll, model::ParamStore& params, int64_t micro_batch, int64_t micro_batches);
  ~PipelineRunner() override;

  using Fetch = std::function<void(int64_t micro, int32_t* tokens)>;  // [micro_batch, S+1] tokens
  // One step's forward and backward passes over every micro-batch: accumulates the gradients
  // into the parameter store, `observer` (the data-parallel gradient sync, may be null) told
  // when each layer's gradients are final in the last micro-batch, and finished (its wait
  // returned in comm_wait_s) at the list's reduce instruction.
  PipelineStepResult run(const Fetch& fetch, const model::LossScale& scale, model::BackwardObserver* observer,
                         const std::function<double()>& finish_reduction);
  // Forward passes only (validation), micro-batch by micro-batch through the stages.
  model::Losses forward_only(int64_t micro_batches, const Fetch& fetch, const model::LossScale& scale);

  const plan::PipelineSchedule& schedule() const { return schedule_; }
  // The first instance of chunk 0 (the whole model without pipeline parallelism).
  model::DeepSeekModel& model() { return *chunks_.at(0).pool.at(0); }
  // Every MoE layer of every instance (load statistics are summed over them), and one per layer
  // number with its router bias (shared by the instances) for the bias update.
  std::vector<model::MoeLayer*> all_moe_layers();
  std::vector<std::pair<int64_t, model::MoeLayer*>> moe_layers_by_id();
  // Every instance's tokens per expert since they were last cleared, by layer number.
  std::vector<std::pair<int64_t, std::vector<int64_t>>> expert_loads();
  // Activation bytes kept per micro-batch on each chunk, summed over the chunks; instances built.
  int64_t saved_activation_bytes_per_micro() const;
  int64_t instances() const;
  int64_t saved_activation_bytes_held() const;  // over every instance built
  int64_t activation_bytes_held() const;        // the same, backward workspaces included
  // ZB-H1: the most bytes of weight-gradient inputs the W queues of all instances held as
  // copies (their sum of per-instance peaks; not in the plan, docs/design.md §6.7).
  int64_t deferred_copy_bytes_peak() const;

  // model::BackwardObserver, installed on every instance.
  void grads_final(int64_t layer) override;
  void poll() override;

 private:
  struct Chunk {
    int virtual_stage = 0;
    model::StageSpec spec;
    std::vector<std::unique_ptr<model::DeepSeekModel>> pool;
    std::vector<std::unique_ptr<model::WeightGradDeferral>> deferred;  // per instance
    std::vector<int> free;
  };
  struct Pending {
    kernels::DeviceArray<float> buf;   // declared first: destroyed after the transfer is waited for
    std::unique_ptr<comm::Work> work;  // (a Work's destructor waits for it)
    // Grouped transfers (device memory), not yet issued: the peer, the length, the direction.
    int peer = -1;
    int64_t n = 0;
    bool grad = false;
  };
  int acquire(int chunk);
  void release(int chunk, int slot);
  void post_receives(size_t from);
  // Waits for a posted receive (the time added to wait_s); returns its buffer.
  const float* wait_receive(int micro, int chunk, bool grad, double& wait_s);
  void reap_sends(bool all);
  // Sends a stage boundary's activations or gradients: at once on host memory; on device memory
  // (NCCL's ordering, comm::Communicator::group_start) kept until the next receive, and issued
  // in one group with it (or by flush_sends).
  void send(bool grad, int peer, const float* src, int64_t n);
  void flush_sends();

  const plan::ParallelPlan& plan_;
  kernels::Backend& be_;
  model::Collectives& coll_;
  model::ParamStore& params_;
  int64_t micro_batch_, seq_;
  int p_ = 1, r_ = 0, v_ = 1;
  plan::PipelineSchedule schedule_;
  bool zero_bubble_ = false;
  std::vector<Chunk> chunks_;
  // The recomputed activations of every instance on this rank (docs/design.md §6.7).
  std::shared_ptr<model::RecomputeArena> recompute_arena_ = std::make_shared<model::RecomputeArena>();
  // The instances' workspace (scratch, conversions, work buffers), one for the rank.
  std::shared_ptr<model::InstanceWorkspace> workspace_ = std::make_shared<model::InstanceWorkspace>();
  std::unique_ptr<comm::Communicator> act_, grad_, embed_;
  std::map<std::pair<int, int>, int> active_;  // (micro, chunk) -> slot
  std::map<std::tuple<int, int, bool>, Pending> receives_;  // (micro, chunk, grad)
  std::vector<Pending> sends_;
  std::vector<Pending> unsent_;  // grouped transfers: copied, not yet issued
  bool grouped_ = false;         // the transfers are grouped (device memory)
  size_t posted_ = 0;  // instructions whose receives are posted
  std::vector<int32_t> tokens_;
  // The embedding's mirror on the last stage (MTP modules without the embedding), and its roles.
  bool mirror_holder_ = false, mirror_source_ = false;
  int64_t mirror_len_ = 0, mirror_words_ = 0;  // elements of the mirror; words its weights travel in
  kernels::DType mirror_dtype_ = kernels::DType::kF32;
  const float* mirror_weights() const;
  kernels::DeviceArray<float> mirror_w_, mirror_g_, mirror_in_;  // in the backend's memory
  std::unique_ptr<comm::Work> mirror_work_;
  bool armed_ = false;  // the op running now makes gradients final (the last micro-batch)
  model::BackwardObserver* observer_ = nullptr;
};

}  // namespace dstrain::runtime
