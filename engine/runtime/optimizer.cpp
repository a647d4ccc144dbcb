#include "engine/runtime/optimizer.h"

#include "engine/parallel/zero/partition.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace dstrain::runtime {

AdamW::AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be)
    : AdamW(cfg, params, be, {0, params.dense_numel()}, {0, params.expert_numel()}) {
  sharded_ = false;
}

AdamW::AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be,
             FlatRange dense_shard, FlatRange expert_shard)
    : cfg_(cfg), params_(params), be_(be), dense_shard_(dense_shard), expert_shard_(expert_shard), sharded_(true) {
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
    const FlatRange& sh = r.expert ? expert_shard_ : dense_shard_;
    const int64_t lo = std::max(r.offset, sh.begin), hi = std::min(r.offset + r.numel, sh.end);
    if (lo < hi) clipped.push_back({r.expert, lo, hi - lo, r.decay});
  }
  runs_ = std::move(clipped);
  m_dense_.assign(dense_shard_.size(), 0.0f);
  v_dense_.assign(dense_shard_.size(), 0.0f);
  m_expert_.assign(expert_shard_.size(), 0.0f);
  v_expert_.assign(expert_shard_.size(), 0.0f);
}

void AdamW::step(double lr, int64_t step, double grad_scale) {
  const config::OptimizerParams& p = cfg_.params;
  kernels::AdamWParams a;
  a.lr = float(lr), a.beta1 = float(p.betas[0]), a.beta2 = float(p.betas[1]), a.eps = float(p.eps);
  a.step = step;
  a.grad_scale = float(grad_scale);
  for (const Run& r : runs_) {
    a.weight_decay = r.decay ? float(p.weight_decay) : 0.0f;
    float* w = (r.expert ? params_.expert_params() : params_.dense_params()).data() + r.offset;
    const float* g = (r.expert ? params_.expert_grads() : params_.dense_grads()).data() + r.offset;
    const int64_t base = r.expert ? expert_shard_.begin : dense_shard_.begin;
    float* m = (r.expert ? m_expert_ : m_dense_).data() + (r.offset - base);
    float* v = (r.expert ? v_expert_ : v_dense_).data() + (r.offset - base);
    if (cfg_.type == "Adam" && !p.adam_w_mode) {
      // L2-regularised Adam: the decay joins the gradient instead of the update. Rare; done
      // with a temporary so the AdamW kernel stays the one path.
      std::vector<float> g2(g, g + r.numel);
      for (int64_t i = 0; i < r.numel; ++i) g2[i] = g2[i] * a.grad_scale + a.weight_decay * w[i];
      kernels::AdamWParams plain = a;
      plain.weight_decay = 0.0f, plain.grad_scale = 1.0f;
      be_.adamw(w, g2.data(), m, v, r.numel, plain);
      continue;
    }
    be_.adamw(w, g, m, v, r.numel, a);
  }
}

ZeroShards zero_shards(int64_t dense_numel, int64_t expert_numel, int dp, int r) {
  const auto d = parallel::partition_flat(dense_numel, dp, 16), e = parallel::partition_flat(expert_numel, dp, 16);
  return {{d[r].begin, d[r].end}, {e[r].begin, e[r].end}, d.back().end, e.back().end};
}

double gradient_square_sum(model::ParamStore& params, FlatRange dense, FlatRange expert) {
  double sum = 0;
  for (const auto& [buf, r] : {std::pair{&params.dense_grads(), dense}, std::pair{&params.expert_grads(), expert}}) {
    const float* g = buf->data();
#pragma omp parallel for simd reduction(+ : sum) schedule(static)
    for (int64_t i = r.begin; i < r.end; ++i) sum += double(g[i]) * double(g[i]);
  }
  return sum;
}

double gradient_norm(model::ParamStore& params) {
  return std::sqrt(gradient_square_sum(params, {0, int64_t(params.dense_grads().size())},
                                       {0, int64_t(params.expert_grads().size())}));
}

double clip_factor(double norm, double max_norm) {
  return max_norm <= 0.0 || norm <= max_norm ? 1.0 : max_norm / (norm + 1e-6);
}

double clip_gradients(model::ParamStore& params, double norm, double max_norm, FlatRange dense, FlatRange expert) {
  const double factor = clip_factor(norm, max_norm);
  if (factor == 1.0) return 1.0;
  for (const auto& [buf, r] : {std::pair{&params.dense_grads(), dense}, std::pair{&params.expert_grads(), expert}}) {
    float* g = buf->data();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = r.begin; i < r.end; ++i) g[i] = float(g[i] * factor);
  }
  return factor;
}

double clip_gradients(model::ParamStore& params, double norm, double max_norm) {
  return clip_gradients(params, norm, max_norm, {0, int64_t(params.dense_grads().size())},
                        {0, int64_t(params.expert_grads().size())});
}

}  // namespace dstrain::runtime
