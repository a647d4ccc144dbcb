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

// [begin, end) of a flat buffer.
struct FlatRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

class AdamW {
 public:
  // Updates the whole flat buffers, or with ZeRO only this rank's shards of them: the moments
  // then exist for the shard alone (exp_avg_dense()[i] belongs to flat element
  // dense_shard().begin + i).
  AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be);
  AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be,
        FlatRange dense_shard, FlatRange expert_shard);

  // One step with learning rate `lr`; `step` is 1-based (bias correction).
  // `grad_scale` multiplies every gradient on the way in (gradient clipping without a pass of
  // its own over the gradients).
  void step(double lr, int64_t step, double grad_scale = 1.0);

  FlatRange dense_shard() const { return dense_shard_; }
  FlatRange expert_shard() const { return expert_shard_; }
  bool sharded() const { return sharded_; }

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
  FlatRange dense_shard_, expert_shard_;
  bool sharded_ = false;
};

// ZeRO's partition of a rank's flat buffers over `dp` data-parallel ranks: equal shards aligned
// to 16 elements (the buffers are padded to dp x the shard size). Shard of rank `r`.
struct ZeroShards {
  FlatRange dense, expert;
  int64_t dense_padded = 0, expert_padded = 0;
};
ZeroShards zero_shards(int64_t dense_numel, int64_t expert_numel, int dp, int r);

// Sum of squared gradients over [dense range) and [expert range) of the flat buffers (double).
double gradient_square_sum(model::ParamStore& params, FlatRange dense, FlatRange expert);
// sqrt of the sum over all of this rank's dense and expert gradients.
double gradient_norm(model::ParamStore& params);

// Scales the gradients (in the given ranges; default all) so their norm is at most max_norm
// (0: no clipping). Returns the factor.
// The factor that brings a gradient of global norm `norm` down to `max_norm` (1 when it is
// under the limit or max_norm is 0: clipping off).
double clip_factor(double norm, double max_norm);
double clip_gradients(model::ParamStore& params, double norm, double max_norm);
double clip_gradients(model::ParamStore& params, double norm, double max_norm, FlatRange dense, FlatRange expert);

}  // namespace dstrain::runtime
