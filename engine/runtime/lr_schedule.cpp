#include "engine/runtime/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace dstrain::runtime {

LrSchedule::LrSchedule(const config::TrainConfig& cfg)
    : sched_(cfg.scheduler), base_lr_(cfg.optimizer.params.lr),
      warmup_(cfg.scheduler ? std::max<int64_t>(2, cfg.scheduler->params.warmup_num_steps) : 2) {}

double LrSchedule::warmup_fraction(int64_t t) const {
  if (sched_->params.warmup_type == config::WarmupType::kLinear) return double(t) / double(warmup_);
  return std::log(double(t + 1)) / std::log(double(warmup_));
}

double LrSchedule::lr(int64_t t) const {
  if (!sched_) return base_lr_;
  const config::SchedulerParams& p = sched_->params;
  const config::SchedulerType type = sched_->type;
  if (type == config::SchedulerType::kWarmupCosineLR) {
    double ratio;
    if (t < warmup_) {
      ratio = p.warmup_min_ratio + (1.0 - p.warmup_min_ratio) * warmup_fraction(t);
    } else {
      const double k = double(t - warmup_ + 1), total = double(*p.total_num_steps - warmup_);
      ratio = std::max(0.0, p.cos_min_ratio + (1.0 - p.cos_min_ratio) * (1.0 + std::cos(M_PI * k / total)) / 2.0);
    }
    return base_lr_ * ratio;
  }
  double gamma = 1.0;
  if (t < warmup_) {
    gamma = warmup_fraction(t);
  } else if (type == config::SchedulerType::kWarmupDecayLR) {
    const double T = double(*p.total_num_steps);
    gamma = std::max(0.0, (T - double(t)) / std::max(1.0, T - double(warmup_)));
  }
  return p.warmup_min_lr + (p.warmup_max_lr - p.warmup_min_lr) * gamma;
}

}  // namespace dstrain::runtime
