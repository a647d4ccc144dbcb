// The training loop on one rank (data parallelism comes with the communicator issue): every
// step accumulates the gradients of `gradient_accumulation_steps` micro-batches of the fixed
// sample order (the loss is the mean over all tokens of the global batch), clips the global
// norm, takes an AdamW step at the scheduled learning rate, and applies the aux-loss-free router
// bias update from the step's expert loads. Rank 0 logs every steps_per_print steps, runs
// validation every data.eval_interval steps, prints expert load statistics, and writes metrics.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "engine/data/token_dataset.h"
#include "engine/model/deepseek_model.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/lr_schedule.h"
#include "engine/runtime/metrics.h"
#include "engine/runtime/optimizer.h"

namespace dstrain::runtime {

struct StepResult {
  model::Losses loss;  // summed over the micro-batches (each already scaled to the global mean)
  double grad_norm = 0, lr = 0;
  double forward_s = 0, backward_s = 0, optimizer_s = 0;
  std::vector<std::vector<int64_t>> expert_loads;  // per MoE layer, this step
};

struct TrainSummary {
  int64_t steps = 0;
  double final_loss = 0, final_val_loss = -1, seconds = 0, tokens_per_sec = 0;
};

class Trainer {
 public:
  // `threads` CPU threads (0: all). The plan must be for one rank.
  Trainer(const plan::ParallelPlan& plan, int threads);
  ~Trainer();

  // Gradients of step `step` (0-based) without touching the weights.
  StepResult compute_gradients(int64_t step);
  // compute_gradients + clipping + AdamW + router bias update.
  StepResult train_step(int64_t step);
  // Mean cross-entropy over data.eval_iters global batches of validation data.
  double validate();
  // The whole run, logging as configured.
  TrainSummary run();

  model::ParamStore& params() { return *params_; }
  const data::TokenDataset& dataset() const { return *dataset_; }
  double peak_flops() const { return peak_flops_; }

 private:
  double measure_peak_flops();
  void log_step(int64_t step, const StepResult& r, double window_s, int64_t window_steps,
                double elapsed_s, const std::optional<double>& val);
  void log_expert_stats(int64_t step, const StepResult& r);

  const plan::ParallelPlan& plan_;
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
};

}  // namespace dstrain::runtime
