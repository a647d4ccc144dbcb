#include "engine/plan/batch_plan.h"

#include <fmt/format.h>

#include "engine/common/error.h"
#include "engine/config/load_config.h"

namespace dstrain::plan {

BatchPlan resolve_batch(const config::TrainConfig& cfg, int64_t dp) {
  const auto& tb = cfg.train_batch_size;
  DS_CHECK(!cfg.train_micro_batch_size_per_gpu || !cfg.train_micro_batch_size_per_gpu->is_auto(),
           "train_micro_batch_size_per_gpu: auto is resolved by make_plan");
  std::optional<int64_t> mb;
  if (cfg.train_micro_batch_size_per_gpu) mb = cfg.train_micro_batch_size_per_gpu->value;
  const auto& ga = cfg.gradient_accumulation_steps;
  BatchPlan b;
  b.dp = dp;
  b.seq_length = cfg.seq_length;
  // Products of the batch's factors, refused at `key` where they leave 64-bit counts (each factor
  // is at most 2^24, config/validate.cpp, but with the data-parallel size three can overflow).
  const auto product = [&](const char* key, std::initializer_list<int64_t> factors) {
    int64_t p = 1;
    for (const int64_t f : factors)
      if (__builtin_mul_overflow(p, f, &p))
        config::fail_at(cfg, key,
                        "micro-batch x accumulation x data-parallel size leaves 64-bit counts; valid: the batch "
                        "sizes of a real run");
    return p;
  };
  const auto need_multiple = [&](const char* key, int64_t value, int64_t factor, const std::string& of) {
    if (value % factor != 0)
      config::fail_at(cfg, key,
                      fmt::format("{} is not divisible by {} = {}; valid: a multiple of {}", value,
                                  of, factor, factor));
  };
  if (tb && mb && ga) {
    const int64_t all = product("train_batch_size", {*mb, *ga, dp});
    if (*tb != all)
      config::fail_at(cfg, "train_batch_size",
                      fmt::format("{} != train_micro_batch_size_per_gpu {} x "
                                  "gradient_accumulation_steps {} x data-parallel size {} = {}; "
                                  "valid: {}, or leave one of the three unset",
                                  *tb, *mb, *ga, dp, all, all));
    b.global = *tb, b.micro = *mb, b.accumulation = *ga;
  } else if (tb && mb) {
    need_multiple("train_batch_size", *tb, product("train_micro_batch_size_per_gpu", {*mb, dp}),
                  fmt::format("train_micro_batch_size_per_gpu {} x data-parallel size {}", *mb, dp));
    b.global = *tb, b.micro = *mb, b.accumulation = *tb / product("train_micro_batch_size_per_gpu", {*mb, dp});
  } else if (tb && ga) {
    need_multiple("train_batch_size", *tb, product("gradient_accumulation_steps", {*ga, dp}),
                  fmt::format("gradient_accumulation_steps {} x data-parallel size {}", *ga, dp));
    b.global = *tb, b.accumulation = *ga, b.micro = *tb / product("gradient_accumulation_steps", {*ga, dp});
  } else if (tb) {
    need_multiple("train_batch_size", *tb, dp, "the data-parallel size");
    b.global = *tb, b.accumulation = 1, b.micro = *tb / dp;
  } else if (mb) {
    b.micro = *mb, b.accumulation = ga.value_or(1);
    b.global = product("train_micro_batch_size_per_gpu", {*mb, b.accumulation, dp});
  } else {
    config::fail_at(cfg, "train_batch_size",
                    "neither train_batch_size nor train_micro_batch_size_per_gpu is set; valid: "
                    "set at least one of them (DeepSpeed's batch triangle)");
  }
  return b;
}

}  // namespace dstrain::plan
