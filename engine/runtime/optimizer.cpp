#include "engine/runtime/optimizer.h"

#include <cmath>

namespace dstrain::runtime {

AdamW::AdamW(const config::OptimizerConfig& cfg, model::ParamStore& params, kernels::Backend& be)
    : cfg_(cfg), params_(params), be_(be) {
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
  m_dense_.assign(params.dense_params().size(), 0.0f);
  v_dense_.assign(params.dense_params().size(), 0.0f);
  m_expert_.assign(params.expert_params().size(), 0.0f);
  v_expert_.assign(params.expert_params().size(), 0.0f);
}

void AdamW::step(double lr, int64_t step) {
  const config::OptimizerParams& p = cfg_.params;
  kernels::AdamWParams a;
  a.lr = float(lr), a.beta1 = float(p.betas[0]), a.beta2 = float(p.betas[1]), a.eps = float(p.eps);
  a.step = step;
  for (const Run& r : runs_) {
    a.weight_decay = r.decay ? float(p.weight_decay) : 0.0f;
    float* w = (r.expert ? params_.expert_params() : params_.dense_params()).data() + r.offset;
    const float* g = (r.expert ? params_.expert_grads() : params_.dense_grads()).data() + r.offset;
    float* m = (r.expert ? m_expert_ : m_dense_).data() + r.offset;
    float* v = (r.expert ? v_expert_ : v_dense_).data() + r.offset;
    if (cfg_.type == "Adam" && !p.adam_w_mode) {
      // L2-regularised Adam: the decay joins the gradient instead of the update. Rare; done
      // with a temporary so the AdamW kernel stays the one path.
      std::vector<float> g2(g, g + r.numel);
      for (int64_t i = 0; i < r.numel; ++i) g2[i] += a.weight_decay * w[i];
      kernels::AdamWParams plain = a;
      plain.weight_decay = 0.0f;
      be_.adamw(w, g2.data(), m, v, r.numel, plain);
      continue;
    }
    be_.adamw(w, g, m, v, r.numel, a);
  }
}

double gradient_norm(model::ParamStore& params) {
  double sum = 0;
  for (auto* buf : {&params.dense_grads(), &params.expert_grads()}) {
    const float* g = buf->data();
    const int64_t n = int64_t(buf->size());
#pragma omp parallel for simd reduction(+ : sum) schedule(static)
    for (int64_t i = 0; i < n; ++i) sum += double(g[i]) * double(g[i]);
  }
  return std::sqrt(sum);
}

double clip_gradients(model::ParamStore& params, double norm, double max_norm) {
  if (max_norm <= 0.0 || norm <= max_norm) return 1.0;
  const double factor = max_norm / (norm + 1e-6);
  for (auto* buf : {&params.dense_grads(), &params.expert_grads()}) {
    float* g = buf->data();
    const int64_t n = int64_t(buf->size());
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) g[i] = float(g[i] * factor);
  }
  return factor;
}

}  // namespace dstrain::runtime
