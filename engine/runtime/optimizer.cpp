#include "engine/runtime/optimizer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "engine/common/error.h"

namespace dstrain::runtime {

AdamW::AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be)
    : AdamW(cfg, params, be, {0, params.dense_numel()}, {0, params.expert_numel()}) {
  sharded_ = false;
}

AdamW::AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be,
             Range dense_shard, Range expert_shard)
    : cfg_(cfg),
      params_(params),
      be_(be),
      m_dense_(&be),
      v_dense_(&be),
      m_expert_(&be),
      v_expert_(&be),
      w_dense_(&be),
      w_expert_(&be),
      dense_shard_(dense_shard),
      expert_shard_(expert_shard),
      sharded_(true) {
  // Consecutive parameters with the same decay setting form one run (one kernel call).
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    if (v.buffer) continue;
    const bool decay = v.info->weight_decay;
    if (!runs_.empty() && runs_.back().expert == v.expert && runs_.back().decay == decay &&
        runs_.back().offset + runs_.back().numel == v.offset)
      runs_.back().numel += v.numel;
    else
      runs_.push_back({v.expert, v.offset, v.numel, decay});
  }
  // Keep only the parts of the runs inside this rank's shards.
  std::vector<Run> clipped;
  for (const Run& r : runs_) {
    const Range in = parallel::intersect({r.offset, r.offset + r.numel}, shard(r.expert));
    if (!in.empty()) clipped.push_back({r.expert, in.begin, in.size(), r.decay});
  }
  runs_ = std::move(clipped);
  master_ = params.has_compute_copy();
  if (master_) take_master();
  m_dense_.assign(dense_shard_.size());
  v_dense_.assign(dense_shard_.size());
  m_expert_.assign(expert_shard_.size());
  v_expert_.assign(expert_shard_.size());
}

void AdamW::take_master() {
  // The compute copies hold the initial weights rounded (as DeepSpeed casts the module before
  // its optimizer copies it): the master weights start from them, widened — exact.
  for (const bool expert : {false, true}) {
    const Range r = shard(expert);
    master(expert).assign(r.size());
    be_.convert({master(expert).data(), kernels::DType::kF32, {r.size()}},
                {params_.compute_copy(expert).data() + r.begin, params_.compute_dtype(), {r.size()}});
  }
}

void AdamW::publish_master() {
  if (!master_) return;
  for (const bool expert : {false, true}) {
    const Range r = shard(expert);
    params_.round_to_compute(be_, expert, r.begin, r.end, master(expert).data());
  }
}

model::FlatArray<float>& AdamW::moment(int k, bool expert) {
  if (k == 0) {
    DS_CHECK(master_, "no master weights without mixed precision");
    return master(expert);
  }
  if (k == 1) return expert ? m_expert_ : m_dense_;
  return expert ? v_expert_ : v_dense_;
}

void AdamW::step(double lr, int64_t step, double grad_scale) {
  const config::OptimizerParams& p = cfg_.params;
  // DeepSpeed's Adam with adam_w_mode false is L2-regularised: the decay joins the gradient.
  const bool l2 = cfg_.type == config::OptimizerType::kAdam && !p.adam_w_mode;
  kernels::AdamWParams a;
  a.lr = float(lr), a.beta1 = float(p.betas[0]), a.beta2 = float(p.betas[1]), a.eps = float(p.eps);
  a.step = step;
  a.grad_scale = float(grad_scale);
  for (const Run& r : runs_) {
    const float decay = r.decay ? float(p.weight_decay) : 0.0f;
    a.weight_decay = l2 ? 0.0f : decay;
    a.l2 = l2 ? decay : 0.0f;
    const int64_t base = shard(r.expert).begin;
    float* w = master_ ? master(r.expert).data() + (r.offset - base)
                       : (r.expert ? params_.expert_params() : params_.dense_params()).data() + r.offset;
    const float* g = (r.expert ? params_.expert_grads() : params_.dense_grads()).data() + r.offset;
    float* m = moment(1, r.expert).data() + (r.offset - base);
    float* v = moment(2, r.expert).data() + (r.offset - base);
    if (!master_) {
      be_.adamw({w, {r.numel}}, {g, {r.numel}}, {m, {r.numel}}, {v, {r.numel}}, a);
      continue;
    }
    // Mixed precision: the updated master weights straight into the compute copy, in one pass
    // (the caller gathers the shards and widens the side copies).
    uint16_t* h = params_.compute_copy(r.expert).data() + r.offset;
    be_.adamw_round({w, {r.numel}}, {g, {r.numel}}, {m, {r.numel}}, {v, {r.numel}}, a,
                    {h, params_.compute_dtype(), {r.numel}}, {});
  }
  if (!master_) return;
  // What no run covers (buffers) is rounded from its master value as before: the shards' gaps.
  for (const bool expert : {false, true}) {
    const Range sh = shard(expert);
    int64_t at = sh.begin;
    const auto gap = [&](int64_t end) {
      if (end > at) params_.round_to_compute(be_, expert, at, end, master(expert).data() + (at - sh.begin));
    };
    for (const Run& r : runs_) {
      if (r.expert != expert) continue;
      gap(r.offset);
      at = r.offset + r.numel;
    }
    gap(sh.end);
  }
}

double gradient_square_sum(kernels::Backend& be, model::ParamStore& params, Range dense, Range expert,
                           bool replicated) {
  const kernels::DeviceArray<double> sum(be, 1);
  be.sum_squares({sum.data(), {1}}, {params.expert_grads().data() + expert.begin, {expert.size()}}, false);
  const float* g = params.dense_grads().data();
  if (replicated) {
    be.sum_squares({sum.data(), {1}}, {g + dense.begin, {dense.size()}}, true);
  } else {
    for (const std::string& name : params.names()) {  // the tensor-parallel shards only
      const model::ParamView& v = params.view(name);
      if (v.buffer || v.expert || v.info->shard == plan::Shard::kReplicated) continue;
      const Range r = parallel::intersect({v.offset, v.offset + v.numel}, dense);
      if (!r.empty()) be.sum_squares({sum.data(), {1}}, {g + r.begin, {r.size()}}, true);
    }
  }
  double host = 0;
  be.copy_to_host(&host, sum.data(), sizeof(double));
  return host;
}

double clip_factor(double norm, double max_norm) {
  return max_norm <= 0.0 || norm <= max_norm ? 1.0 : max_norm / (norm + 1e-6);
}

}  // namespace dstrain::runtime
