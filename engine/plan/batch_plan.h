// The batch triangle, resolved as DeepSpeed does:
//   train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP
// any two give the third; one alone takes accumulation 1; all three must agree.
#pragma once

#include <cstdint>

#include "engine/config/train_config.h"

namespace dstrain::plan {

struct BatchPlan {
  int64_t global = 0;        // sequences per optimizer step (all ranks)
  int64_t micro = 0;         // sequences per micro-batch per data-parallel rank
  int64_t accumulation = 0;  // micro-batches per step (= pipeline micro-batches)
  int64_t dp = 1;
  int64_t seq_length = 0;
  int64_t tokens_per_step() const { return global * seq_length; }
};

// Throws ConfigError naming the keys and the numbers when they cannot be satisfied.
BatchPlan resolve_batch(const config::TrainConfig& cfg, int64_t dp);

}  // namespace dstrain::plan
