// The training loop. Every step accumulates the gradients of `gradient_accumulation_steps`
// micro-batches of the fixed sample order (the loss is the mean over all tokens of the global
// batch), sums them over the data-parallel ranks, clips the global norm, takes an AdamW step at
// the scheduled learning rate, and applies the aux-loss-free router-bias update from the step's
// expert loads. Rank 0 logs every steps_per_print steps, runs validation every
// data.eval_interval steps, prints expert load statistics and writes metrics. Checkpoints are
// saved every checkpoint.interval steps, at the end, and on SIGTERM / SIGINT (then the run
// stops cleanly); checkpoint.resume picks the checkpoint to continue from.
//
// Layouts: data parallelism with ZeRO 0/1/2, the gradients reduced in buckets during the
// backward pass (engine/parallel/grad_sync.h); tensor, pipeline and expert parallelism are
// not trained yet.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "engine/comm/communicator.h"
#include "engine/data/token_dataset.h"
#include "engine/model/deepseek_model.h"
#include "engine/parallel/grad_sync.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/lr_schedule.h"
#include "engine/runtime/metrics.h"
#include "engine/runtime/optimizer.h"

namespace dstrain::runtime {

struct StepResult {
  model::Losses loss;  // summed over the micro-batches (each already scaled to the global mean)
  double grad_norm = 0, lr = 0;
  double forward_s = 0, backward_s = 0, optimizer_s = 0;
  double comm_wait_s = 0;  // waiting for the gradient reduction after the backward pass
  std::vector<std::vector<int64_t>> expert_loads;  // per MoE layer, this step
};

struct TrainSummary {
  int64_t steps = 0;  // steps completed when the run ended
  bool stopped = false;  // by SIGTERM / SIGINT
  double final_loss = 0, final_val_loss = -1, seconds = 0, tokens_per_sec = 0;
};

class Trainer {
 public:
  // `threads` CPU threads (0: all). `world`: the MPI communicator of the job, or MPI_COMM_NULL
  // for a single process. Resumes per checkpoint.resume.
  Trainer(const plan::ParallelPlan& plan, int threads, MPI_Comm world = MPI_COMM_NULL);
  ~Trainer();

  // Gradients of step `step` (0-based) without touching the weights.
  StepResult compute_gradients(int64_t step);
  // compute_gradients + clipping + AdamW + router bias update.
  StepResult train_step(int64_t step);
  // Mean cross-entropy over data.eval_iters global batches of validation data.
  double validate();
  // The whole run from the resumed step, logging and saving as configured.
  TrainSummary run();
  // Saves a checkpoint of the state after `steps_done` steps (collective).
  std::string save_checkpoint(int64_t steps_done);
  int64_t start_step() const { return start_step_; }

  // Asks a running loop to save and stop after the current step. Returns false when no loop is
  // running or a stop was already requested (the caller should then exit at once).
  static bool request_stop(int signal);

  model::ParamStore& params() { return *params_; }
  const data::TokenDataset& dataset() const { return *dataset_; }
  double peak_flops() const { return peak_flops_; }

 private:
  double measure_peak_flops();
  void reduce_losses(StepResult& r);
  double global_grad_norm();
  void gather_parameters();
  void log_step(int64_t step, const StepResult& r, double window_s, int64_t window_steps,
                double elapsed_s, const std::optional<double>& val);
  void log_expert_stats(int64_t step, const StepResult& r);

  const plan::ParallelPlan plan_;  // owned: the parameter store's views point into its registry
  const config::TrainConfig& cfg_;
  std::unique_ptr<kernels::Backend> be_;
  std::unique_ptr<model::ParamStore> params_;
  model::LocalCollectives coll_;
  std::unique_ptr<model::DeepSeekModel> model_;
  std::unique_ptr<data::TokenDataset> dataset_;
  std::unique_ptr<AdamW> adam_;
  LrSchedule schedule_;
  MetricsFile metrics_;
  TensorBoardWriter tensorboard_;
  std::vector<int32_t> tokens_;
  double peak_flops_ = 0;
  MPI_Comm world_ = MPI_COMM_NULL;
  int rank_ = 0, dp_size_ = 1, zero_ = 0;
  std::unique_ptr<comm::Communicator> world_comm_;  // every rank (stop requests)
  std::unique_ptr<comm::Communicator> dp_;  // the data-parallel group (when more than one rank)
  std::unique_ptr<parallel::GradSync> grad_sync_;  // bucketed gradient reduction over dp_
  FlatRange dense_shard_, expert_shard_;   // this rank's ZeRO shards (the whole buffers without)
  std::unique_ptr<Checkpointer> checkpointer_;
  int64_t start_step_ = 0;
  int64_t skip_sync_step_ = 0;  // fault injection (DSTRAIN_FAULT_INJECT=skip_grad_sync:N)
};

}  // namespace dstrain::runtime
