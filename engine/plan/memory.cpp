#include "engine/plan/memory.h"

namespace dstrain::plan {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

MemoryEstimate estimate_memory(int64_t dense, int64_t expert, int64_t dp, int64_t edp,
                               int zero_stage, config::Precision precision) {
  const bool mixed = precision != config::Precision::kFp32;
  const double held = static_cast<double>(dense + expert);
  const double sharded = static_cast<double>(ceil_div(dense, dp) + ceil_div(expert, edp));
  MemoryEstimate m;
  m.weights = (mixed ? 2.0 : 4.0) * held;
  m.gradients = 4.0 * (zero_stage >= 2 ? sharded : held);
  const double state_per_param = mixed ? 12.0 : 8.0;  // (master +) m + v
  m.optimizer = state_per_param * (zero_stage >= 1 ? sharded : held);
  return m;
}

}  // namespace dstrain::plan
