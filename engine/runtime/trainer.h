// The training loop. Every step accumulates the gradients of `gradient_accumulation_steps`
// micro-batches of the fixed sample order (the loss is the mean over all tokens of the global
// batch), sums them over the data-parallel ranks, clips the global norm, takes an AdamW step at
// the scheduled learning rate, and applies the aux-loss-free router-bias update from the step's
// expert loads. Rank 0 logs every steps_per_print steps, runs validation every
// data.eval_interval steps, prints expert load statistics and writes metrics. Checkpoints are
// saved every checkpoint.interval steps, at the end, and on SIGTERM / SIGINT (then the run
// stops cleanly); checkpoint.resume picks the checkpoint to continue from.
//
// The rank's engine comes from build_rank_engine (rank_engine.h), every communicator from the
// plan's process groups. Every layout the config accepts trains: data parallelism with ZeRO 0/1/2
// (the gradients reduced in buckets during the backward pass, engine/parallel/grad_sync.h),
// tensor parallelism with sequence parallelism, pipeline schedules (pipeline_runner.h) and
// expert parallelism, in any combination.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/data/token_dataset.h"
#include "engine/model/deepseek_model.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/loss_scaler.h"
#include "engine/runtime/lr_schedule.h"
#include "engine/runtime/metrics.h"
#include "engine/runtime/optimizer.h"
#include "engine/runtime/rank_engine.h"

namespace dstrain::runtime {

struct StepResult {
  model::Losses loss;  // summed over the micro-batches (each already scaled to the global mean)
  double grad_norm = 0, lr = 0;
  double forward_s = 0, backward_s = 0, optimizer_s = 0;
  double comm_wait_s = 0;  // waiting for the gradient reduction after the backward pass
  double tp_comm_s = 0;    // inside the tensor-parallel collectives (forward and backward)
  // Pipeline: waiting for activations and gradients; this rank's compute; the step's span to the
  // end of its last compute op (the measured bubble is 1 - busy / span on the busiest rank).
  double pp_wait_s = 0, pp_busy_s = 0, pp_span_s = 0;
  double pp_bubble = 0, pp_simulated_bubble = 0;  // with wall_clock_breakdown
  // Expert parallelism: waiting for the token exchanges (what compute did not hide) and the
  // bytes this rank sent in them.
  double ep_wait_s = 0, ep_bytes = 0;
  std::vector<std::vector<int64_t>> expert_loads;  // per MoE layer, this step
  // Set when the loss or the gradient norm is not finite: what went wrong. The weights, the
  // optimizer state and the router biases were then left as they were before the step.
  std::string diverged;
  // fp16: the loss scale the step ran with, whether it was skipped for overflow, and the steps
  // skipped so far in the run.
  double loss_scale = 0;
  bool skipped = false;
  int64_t skipped_steps = 0;
};

struct TrainSummary {
  int64_t steps = 0;  // steps completed when the run ended
  bool stopped = false;  // by SIGTERM / SIGINT
  double final_loss = 0, final_val_loss = -1, seconds = 0, tokens_per_sec = 0;
};

class Trainer {
 public:
  // `threads` CPU threads (0: all). `groups`: this rank's process groups. Resumes per
  // checkpoint.resume. Collective over the groups.
  Trainer(const plan::ParallelPlan& plan, RankGroups groups, int threads);
  // A single process without MPI.
  Trainer(const plan::ParallelPlan& plan, int threads);
  ~Trainer();

  // Gradients of step `step` (0-based) without touching the weights.
  StepResult compute_gradients(int64_t step);
  // compute_gradients + clipping + AdamW + router bias update; nothing is updated when the step
  // diverged (StepResult::diverged).
  StepResult train_step(int64_t step);
  // Mean cross-entropy over data.eval_iters global batches of validation data.
  double validate();
  // The whole run from the resumed step, logging and saving as configured.
  TrainSummary run();
  // Saves a checkpoint of the state after `steps_done` steps (collective).
  std::string save_checkpoint(int64_t steps_done);
  int64_t start_step() const { return start_step_; }
  // Collective over the world: every rank's memory breakdown (weights, gradients, optimizer
  // state, activations, workspace, communication buffers; planned and measured) to rank 0, which
  // logs it as a table — every rank with `all_ranks`, else rank 0 and the largest of each kind —
  // with each process's peak resident memory (or its GPU pool's peak).
  void log_memory_breakdown(bool all_ranks);
  // --memory-breakdown: one training step (not saved), then every rank's breakdown.
  void memory_report();

  // Asks a running loop to save and stop after the current step. Returns false when no loop is
  // running or a stop was already requested (the caller should then exit at once).
  static bool request_stop(int signal);

  model::ParamStore& params() { return *engine_.params; }
  const data::TokenDataset& dataset() const { return *dataset_; }

 private:
  double measure_peak_flops();
  std::string divergence(int64_t step, const StepResult& r);
  void reduce_losses(StepResult& r);
  std::vector<std::vector<int64_t>> local_expert_loads();
  void pipeline_bubble(StepResult& r, const PipelineStepResult& p);
  double global_grad_norm();
  void log_step(int64_t step, const StepResult& r, double window_s, int64_t window_steps,
                double elapsed_s, const std::optional<double>& val);
  void log_expert_stats(int64_t step, const StepResult& r);
  void agree_on_start(const std::string& local_error);
  // This rank's memory by kind — weights, gradients, optimizer state, activations, workspace,
  // communication buffers — planned (the plan's figures for its stage) and measured (what its
  // buffers hold now), in bytes: {planned[6], measured[6]}.
  std::vector<double> memory_figures();
  // Stops the trace, writes this rank's events beside monitor.trace and, on rank 0, merges every
  // rank's into monitor.trace (collective over the world).
  void write_trace();
  // Rank 0: the comms log's table in the log, and its records in the metrics file.
  void report_comm_log(int64_t steps);
  // monitor.op_breakdown: the op times of the step begun at t0 (waiting for the device), added to
  // the run's unless it is the run's first step; op timing off until the next step.
  void add_op_times(int64_t step, std::chrono::steady_clock::time_point t0);
  // Rank 0: the mean op time per step, by op (monitor.op_breakdown).
  void report_op_breakdown();
  void publish_weights();

  const plan::ParallelPlan plan_;  // owned: the parameter store's views point into its registry
  const config::TrainConfig& cfg_;
  RankGroups groups_;
  std::unique_ptr<data::TokenDataset> dataset_;  // before the engine: bad data fails before allocating
  RankEngine engine_;
  std::unique_ptr<comm::Communicator> world_;  // every rank: stop requests, the gradient norm
  std::unique_ptr<AdamW> adam_;
  LrSchedule schedule_;
  MetricsFile metrics_;
  TensorBoardWriter tensorboard_;
  std::unique_ptr<comm::Communicator> pp_;  // the pipeline group (null without pipeline parallelism)
  std::vector<int64_t> moe_ids_;  // the layer number of every MoE layer of the model, in order
  double peak_flops_ = 0;
  int rank_ = 0;      // world rank
  int dp_rank_ = 0;   // data-parallel coordinate: which slice of every global batch
  int dp_size_ = 1;
  std::unique_ptr<Checkpointer> checkpointer_;
  int64_t start_step_ = 0;
  int64_t saved_step_ = -1;  // the step of the newest checkpoint of this run (or the resumed one)
  std::string saved_path_;   // and its file
  int64_t skip_sync_step_ = 0;  // fault injection (Fault::kSkipGradSync)
  int64_t inf_grad_step_ = 0;   // fault injection (Fault::kInfGradient)
  std::optional<LossScaler> scaler_;  // fp16
  // monitor.op_breakdown: this rank's op times summed over the steps after the run's first.
  std::map<std::string, kernels::OpTime> op_times_;
  int64_t op_steps_ = 0, op_first_ = 0;
  double op_step_s_ = 0;
};

}  // namespace dstrain::runtime
