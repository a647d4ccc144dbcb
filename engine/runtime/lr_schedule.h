// Learning-rate schedules with DeepSpeed's names, parameters and formulas
// (deepspeed/runtime/lr_schedules.py). Optimizer step t (0-based: the number of steps already
// taken) uses the formula at last_batch_iteration = t, i.e. the value DeepSpeed's scheduler
// holds after its t-th step() call. warmup_num_steps below 2 counts as 2, as in DeepSpeed.
//
//   WarmupLR:       lr = min + (max - min) * gamma,  gamma = log(t+1)/log(W) (log) or t/W
//                   (linear) while t < W, then 1
//   WarmupDecayLR:  the same warmup, then gamma = max(0, (T - t) / max(1, T - W))
//   WarmupCosineLR: ratio = warmup_min_ratio + (1 - warmup_min_ratio) * warmup(t) while t < W,
//                   then max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi k / (T - W))) / 2)
//                   with k = t - W + 1; lr = optimizer.params.lr * ratio
//   no scheduler:   lr = optimizer.params.lr
#pragma once

#include <cstdint>

#include "engine/config/train_config.h"

namespace dstrain::runtime {

class LrSchedule {
 public:
  explicit LrSchedule(const config::TrainConfig& cfg);
  double lr(int64_t t) const;

 private:
  double warmup_fraction(int64_t t) const;  // 0 -> 1 over the warmup
  std::optional<config::SchedulerConfig> sched_;
  double base_lr_;
  int64_t warmup_;
};

}  // namespace dstrain::runtime
