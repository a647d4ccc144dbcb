// AdamW over a rank's parameter store (PyTorch / DeepSpeed semantics: decoupled weight decay,
// bias correction), weight decay only on the parameters the registry marks (matrices; not norms,
// biases or buffers), fp32 moments in flat buffers parallel to the parameters. Plus the global
// gradient norm and clipping (DeepSpeed: scale by max_norm / (norm + 1e-6) when norm > max_norm).
#pragma once

#include <cstdint>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/config/train_config.h"
#include "engine/model/param_store.h"

namespace dstrain::runtime {

class AdamW {
 public:
  AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be);

  // One step with learning rate `lr`; `step` is 1-based (bias correction).
  void step(double lr, int64_t step);

  std::vector<float>& exp_avg_dense() { return m_dense_; }
  std::vector<float>& exp_avg_sq_dense() { return v_dense_; }
  std::vector<float>& exp_avg_expert() { return m_expert_; }
  std::vector<float>& exp_avg_sq_expert() { return v_expert_; }

 private:
  struct Run {  // a contiguous range of one flat buffer with one weight-decay setting
    bool expert;
    int64_t offset, numel;
    bool decay;
  };
  config::OptimizerConfig cfg_;
  model::ParamStore& params_;
  kernels::Backend& be_;
  std::vector<Run> runs_;
  std::vector<float> m_dense_, v_dense_, m_expert_, v_expert_;
};

// sqrt(sum of squared gradients) over this rank's dense and expert gradients (double sums).
double gradient_norm(model::ParamStore& params);

// Scales the gradients so their norm is at most max_norm (0: no clipping). Returns the factor.
double clip_gradients(model::ParamStore& params, double norm, double max_norm);

}  // namespace dstrain::runtime
