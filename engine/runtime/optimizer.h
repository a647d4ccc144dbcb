// AdamW over a rank's parameter store (PyTorch / DeepSpeed semantics: decoupled weight decay,
// bias correction; DeepSpeed's Adam with adam_w_mode false adds the decay to the gradient
// instead, L2), weight decay only on the parameters the registry marks (matrices; not norms,
// biases or buffers), fp32 moments in flat buffers parallel to the parameters — for the whole
// buffers, or with ZeRO (engine/parallel/zero/zero_sharding.h) for this rank's shards only.
// Plus the global gradient norm's local part and DeepSpeed's clipping factor.
#pragma once

#include <cstdint>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/config/train_config.h"
#include "engine/model/param_store.h"
#include "engine/parallel/zero/partition.h"

namespace dstrain::runtime {

using parallel::Range;

class AdamW {
 public:
  // Updates the whole flat buffers.
  AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be);
  // Updates only [dense_shard) and [expert_shard) of them: the moments then exist for the shards
  // alone (exp_avg_dense()[i] belongs to flat element dense_shard().begin + i).
  AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be, Range dense_shard,
        Range expert_shard);

  // One step with learning rate `lr`; `step` is 1-based (bias correction). `grad_scale`
  // multiplies every gradient on the way in (gradient clipping without a pass of its own).
  // Allocates nothing.
  void step(double lr, int64_t step, double grad_scale = 1.0);

  Range dense_shard() const { return dense_shard_; }
  Range expert_shard() const { return expert_shard_; }
  Range shard(bool expert) const { return expert ? expert_shard_ : dense_shard_; }
  // Whether the moments cover only a part of the buffers.
  bool sharded() const { return sharded_; }

  // The moments live where the parameters do (FlatArray: host memory on the CPU, device memory
  // on a GPU; the host reads them through read / to_host).
  model::FlatArray<float>& exp_avg_dense() { return m_dense_; }
  model::FlatArray<float>& exp_avg_sq_dense() { return v_dense_; }
  model::FlatArray<float>& exp_avg_expert() { return m_expert_; }
  model::FlatArray<float>& exp_avg_sq_expert() { return v_expert_; }
  // Moment k (1: exp_avg, 2: exp_avg_sq) of the dense or expert buffer; k = 0: the fp32 master
  // weights under mixed precision.
  model::FlatArray<float>& moment(int k, bool expert);

  // Mixed precision (the parameter store has compute copies, docs/design.md §6.10): the fp32
  // master weights of the shards live here, beside the moments (master(expert)[i] is flat element
  // shard(expert).begin + i) — the only fp32 copy of the weights. At construction they are taken
  // from the store's compute copies (the initial weights, rounded, as DeepSpeed copies its cast
  // module); step() updates them and rounds the shards into the store's compute copies, which
  // the caller then all-gathers and widens (ParamStore::widen_compute).
  bool has_master() const { return master_; }
  model::FlatArray<float>& master(bool expert) { return expert ? w_expert_ : w_dense_; }
  // After master weights were written (a checkpoint's): rounds this rank's shards into the
  // store's compute copies; the caller gathers them as after a step.
  void publish_master();

 private:
  void take_master();
  struct Run {  // a contiguous range of one flat buffer with one weight-decay setting
    bool expert;
    int64_t offset, numel;
    bool decay;
  };
  config::OptimizerConfig cfg_;
  model::ParamStore& params_;
  kernels::Backend& be_;
  std::vector<Run> runs_;
  model::FlatArray<float> m_dense_, v_dense_, m_expert_, v_expert_;
  bool master_ = false;
  model::FlatArray<float> w_dense_, w_expert_;  // fp32 master weights of the shards (mixed precision)
  Range dense_shard_, expert_shard_;
  bool sharded_ = false;
};

// Sum of squared gradients over [dense) and [expert) of the flat gradient buffers (double).
// Without `replicated`, the dense parameters every tensor-parallel rank holds whole (norms, the
// router, the low-rank projections) are left out: the tensor-parallel ranks other than 0 count
// only their shards, so a sum over the ranks counts each gradient once.
// Summed on the backend's device (Backend::sum_squares, in double) and copied to the host once.
double gradient_square_sum(kernels::Backend& be, model::ParamStore& params, Range dense, Range expert,
                           bool replicated = true);

// The factor that brings a gradient of global norm `norm` down to `max_norm` (DeepSpeed:
// max_norm / (norm + 1e-6) when norm > max_norm; 1 under the limit or when max_norm is 0).
double clip_factor(double norm, double max_norm);

}  // namespace dstrain::runtime
