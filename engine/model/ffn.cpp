#include "engine/model/ffn.h"

#include <fmt/format.h>

namespace dstrain::model {

SwiGluMlp::SwiGluMlp(const LayerEnv& env, const std::string& prefix, int64_t width,
                     int64_t max_tokens)
    : env_(env), H_(env.cfg->hidden_size), w_(width) {
  ParamStore& p = *env.params;
  gate_up_.bind(p, prefix + "gate_proj.weight");
  down_.bind(p, prefix + "down_proj.weight");
  DS_CHECK(p.param(prefix + "up_proj.weight") == gate_up_.w + w_ * H_,
           "{}gate_proj and up_proj must be adjacent in the flat buffer", prefix);
  GU_.resize(max_tokens * 2 * w_);
  M_.resize(max_tokens * w_);
}

void SwiGluMlp::forward(float* out, const float* u, int64_t N) {
  kernels::Backend& be = *env_.be;
  linear_forward(be, GU_.data(), u, gate_up_.w, N, 2 * w_, H_);
  be.swiglu_forward(M_.data(), GU_.data(), N, w_);
  linear_forward(be, out, M_.data(), down_.w, N, H_, w_);  // row-parallel: this rank's part of the sum
}

void SwiGluMlp::backward(float* du, const float* dout, const float* u, int64_t N, float beta) {
  kernels::Backend& be = *env_.be;
  Scratch& scratch = *env_.scratch;
  float* dM = scratch.take(N * w_);
  float* dGU = scratch.take(N * 2 * w_);
  linear_backward(be, dM, down_.g, dout, M_.data(), down_.w, N, H_, w_);
  env_.poll();
  be.swiglu_backward(dGU, dM, GU_.data(), N, w_);
  // Column-parallel gate/up: the input gradient is this rank's part (the caller sums over TP).
  linear_backward(be, du, gate_up_.g, dGU, u, gate_up_.w, N, 2 * w_, H_, beta);
}

MoeLayer::MoeLayer(const LayerEnv& env, const std::string& prefix, int64_t B, int64_t S) : env_(env) {
  const config::ModelConfig& m = *env.cfg;
  H_ = m.hidden_size, E_ = m.num_routed(), k_ = m.num_experts_per_tok, I_ = m.moe_intermediate_size;
  rp_.num_experts = E_, rp_.top_k = k_, rp_.n_group = m.n_group, rp_.topk_group = m.topk_group;
  rp_.scoring = m.scoring_func == config::ScoringFunc::kSoftmax ? kernels::ScoringFunc::kSoftmax
                                                                : kernels::ScoringFunc::kSigmoid;
  switch (m.topk_method) {
    case config::TopkMethod::kNoauxTc: rp_.method = kernels::TopkMethod::kNoauxTc; break;
    case config::TopkMethod::kGreedy: rp_.method = kernels::TopkMethod::kGreedy; break;
    case config::TopkMethod::kGroupLimitedGreedy: rp_.method = kernels::TopkMethod::kGroupLimitedGreedy; break;
  }
  rp_.norm_topk_prob = m.norm_topk_prob;
  rp_.routed_scaling_factor = float(m.routed_scaling_factor);
  rp_.v2_weights = m.model_type == config::ModelType::kDeepseekV2;
  ParamStore& p = *env.params;
  const std::string mlp = prefix + "mlp.";
  gate_.bind(p, mlp + "gate.weight");
  if (p.has(mlp + "gate.e_score_correction_bias")) bias_ = p.param(mlp + "gate.e_score_correction_bias");
  gate_up_.resize(E_);
  down_.resize(E_);
  for (int64_t e = 0; e < E_; ++e) {
    const std::string ex = fmt::format("{}experts.{}.", mlp, e);
    if (!p.has(ex + "gate_proj.weight")) continue;  // another expert-parallel rank's expert
    gate_up_[e].bind(p, ex + "gate_proj.weight");
    down_[e].bind(p, ex + "down_proj.weight");
    DS_CHECK(p.param(ex + "up_proj.weight") == gate_up_[e].w + I_ * H_, "{} not adjacent", ex);
  }
  int64_t N = B * S;
  if (m.num_shared() > 0)
    shared_ = std::make_unique<SwiGluMlp>(env, mlp + "shared_experts.",
                                          m.num_shared() * I_ / env.tp_size, N);
  N = token_part(B * S, env.tp_size, 0).count;  // the most tokens this rank routes
  scores_.resize(N * E_), w_.resize(N * k_), dscores_.resize(N * E_);
  Xp_.resize(N * k_ * H_), GUp_.resize(N * k_ * 2 * I_), Mp_.resize(N * k_ * I_), Yp_.resize(N * k_ * H_);
  idx_.resize(N * k_), pos_.resize(N * k_), src_.resize(N * k_);
  counts_.assign(E_, 0), offsets_.assign(E_ + 1, 0);
  stats_.loads.assign(E_, 0);
}

int64_t MoeLayer::saved_floats() const {
  return int64_t(scores_.size() + w_.size() + dscores_.size() + Xp_.size() + GUp_.size() +
                 Mp_.size() + Yp_.size() + idx_.size() + pos_.size() + src_.size()) +
         (shared_ ? shared_->saved_floats() : 0);
}

int64_t MoeLayer::scratch_floats(int64_t N) const {
  const int64_t rows = N * k_;
  return rows * (2 * H_ + 3 * I_) + N * (k_ + 2 * E_) + E_ * H_ + (shared_ ? shared_->scratch_floats(N) : 0) + 192;
}

// Router, then the dispatch plan: rows sorted by (expert, token, slot), pos[t,j] = row of slot j.
void MoeLayer::route(const float* u, int64_t N) {
  kernels::Backend& be = *env_.be;
  float* logits = env_.scratch->take(N * E_);
  linear_forward(be, logits, u, gate_.w, N, E_, H_);
  be.router_forward(idx_.data(), w_.data(), scores_.data(), logits, bias_, N, rp_);
  std::fill(counts_.begin(), counts_.end(), 0);
  for (int64_t i = 0; i < N * k_; ++i) ++counts_[idx_[i]];
  for (int64_t e = 0; e < E_; ++e) offsets_[e + 1] = offsets_[e] + counts_[e];
  std::vector<int64_t> cursor(offsets_.begin(), offsets_.end() - 1);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k_; ++j) {
      const int64_t row = cursor[idx_[t * k_ + j]]++;
      pos_[t * k_ + j] = int32_t(row);
      src_[row] = int32_t(t);
    }
  for (int64_t e = 0; e < E_; ++e) stats_.loads[e] += counts_[e];
}

// Sequence-wise (or batch-wise) balance loss, docs/model.md §5.2. Its gradient with respect to the
// scores does not depend on anything downstream, so it is computed here and kept for backward.
// Under tensor parallelism each rank holds the routing of its token part only: the statistics
// of every sequence (expert counts f and mean normalised scores P) are summed over the ranks
// first, so every rank computes the whole loss and the gradient of its own tokens.
void MoeLayer::balance_loss(TokenPart part, int64_t B, int64_t S, const LossScale& scale) {
  const double alpha = env_.cfg->aux_loss_alpha;
  const int64_t n = part.count;
  std::fill(dscores_.begin(), dscores_.begin() + n * E_, 0.0f);
  if (alpha <= 0.0) return;
  const bool per_seq = env_.cfg->seq_aux;
  const int64_t groups = per_seq ? B : 1, T = per_seq ? S : B * S;
  // Each group's weight in the global mean: 1/B_global per sequence, or this micro-batch's share.
  const double group_weight = per_seq ? 1.0 / scale.sequences : double(B) / scale.sequences;
  std::vector<double> stats(size_t(2 * groups * E_), 0.0);  // f [groups, E], then P [groups, E]
  double* f = stats.data();
  double* P = stats.data() + groups * E_;
  const auto group_of = [&](int64_t i) { return per_seq ? (part.first + i) / S : 0; };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = group_of(i);
    for (int64_t j = 0; j < k_; ++j) f[g * E_ + idx_[i * k_ + j]] += double(E_) / double(k_ * T);
    double sum = 0;
    for (int64_t e = 0; e < E_; ++e) sum += scores_[i * E_ + e];
    for (int64_t e = 0; e < E_; ++e) P[g * E_ + e] += scores_[i * E_ + e] / sum / double(T);
  }
  if (env_.tp_size > 1) {  // every rank's tokens of each group
    std::vector<float> sum(stats.begin(), stats.end());
    env_.coll->tp_all_reduce(sum.data(), int64_t(sum.size()));
    std::copy(sum.begin(), sum.end(), stats.begin());
  }
  for (int64_t g = 0; g < groups; ++g) {
    double loss = 0;
    for (int64_t e = 0; e < E_; ++e) loss += f[g * E_ + e] * P[g * E_ + e];
    stats_.aux_loss += alpha * group_weight * loss;
  }
  // dL/ds'_{t,e} = alpha w f_e / T, then through s' = s / sum(s).
  for (int64_t i = 0; i < n; ++i) {
    const double* fg = f + group_of(i) * E_;
    const float* s = &scores_[i * E_];
    double sum = 0, dot = 0;
    for (int64_t e = 0; e < E_; ++e) sum += s[e];
    for (int64_t e = 0; e < E_; ++e) dot += alpha * group_weight * fg[e] / double(T) * s[e] / sum;
    for (int64_t e = 0; e < E_; ++e)
      dscores_[i * E_ + e] = float((alpha * group_weight * fg[e] / double(T) - dot) / sum);
  }
}

void MoeLayer::forward(float* out_full, const float* u_full, const float* u_part, TokenPart part, int64_t B,
                       int64_t S, const LossScale& scale) {
  kernels::Backend& be = *env_.be;
  const int64_t N = B * S, n = part.count, rows = n * k_;
  env_.scratch->reset();
  route(u_part, n);
  balance_loss(part, B, S, scale);
  be.gather_rows(Xp_.data(), u_part, src_.data(), rows, H_);
  std::vector<float*> C;
  std::vector<const float*> A, Bw;
  std::vector<int64_t> M, Nn, K;
  for (int64_t e = 0; e < E_; ++e) {
    if (!gate_up_[e] || counts_[e] == 0) continue;
    C.push_back(GUp_.data() + offsets_[e] * 2 * I_);
    A.push_back(Xp_.data() + offsets_[e] * H_);
    Bw.push_back(gate_up_[e].w);
    M.push_back(counts_[e]), Nn.push_back(2 * I_), K.push_back(H_);
  }
  be.gemm_grouped(C.data(), A.data(), Bw.data(), M.data(), Nn.data(), K.data(), int64_t(C.size()),
                  false, true, 1.0f, 0.0f);
  be.swiglu_forward(Mp_.data(), GUp_.data(), rows, I_);
  size_t i = 0;
  for (int64_t e = 0; e < E_; ++e) {
    if (!gate_up_[e] || counts_[e] == 0) continue;
    C[i] = Yp_.data() + offsets_[e] * H_;
    A[i] = Mp_.data() + offsets_[e] * I_;
    Bw[i] = down_[e].w;
    Nn[i] = H_, K[i] = I_;
    ++i;
  }
  be.gemm_grouped(C.data(), A.data(), Bw.data(), M.data(), Nn.data(), K.data(), int64_t(C.size()),
                  false, true, 1.0f, 0.0f);
  if (shared_) shared_->forward(out_full, u_full, N);
  else be.fill(out_full, 0.0f, N * H_);
  be.moe_combine(out_full + part.first * H_, Yp_.data(), w_.data(), pos_.data(), n, k_, H_);
}

namespace {

// The experts' GEMMs of one kind, launched as one grouped call.
struct Group {
  std::vector<float*> C;
  std::vector<const float*> A, B;
  std::vector<int64_t> M, N, K;
  void add(float* c, const float* a, const float* b, int64_t m, int64_t n, int64_t k) {
    C.push_back(c), A.push_back(a), B.push_back(b), M.push_back(m), N.push_back(n), K.push_back(k);
  }
};

// The experts' weight gradients dW_e += dY_e^T X_e (A: rows of dY in `dy` [a_len], B: rows of X
// in `x` [b_len]) now, or — under a WeightGradDeferral — later, from copies of dy and x.
void run_weight_grads(kernels::Backend& be, Group g, const float* dy, int64_t a_len, const float* x, int64_t b_len) {
  if (g.C.empty()) return;
  WeightGradDeferral* d = WeightGradDeferral::active();
  if (!d) {
    be.gemm_grouped(g.C.data(), g.A.data(), g.B.data(), g.M.data(), g.N.data(), g.K.data(), int64_t(g.C.size()),
                    true, false, 1.0f, 1.0f);
    return;
  }
  auto dyc = d->keep(dy, a_len), xc = d->keep(x, b_len);
  for (auto& a : g.A) a = dyc.data + (a - dy);
  for (auto& b : g.B) b = xc.data + (b - x);
  d->push([&be, g = std::move(g), dyc, xc]() mutable {
    be.gemm_grouped(g.C.data(), g.A.data(), g.B.data(), g.M.data(), g.N.data(), g.K.data(), int64_t(g.C.size()),
                    true, false, 1.0f, 1.0f);
  });
}

thread_local WeightGradDeferral* g_active_deferral = nullptr;

}  // namespace

WeightGradDeferral* WeightGradDeferral::active() { return g_active_deferral; }
WeightGradDeferral::Scope::Scope(WeightGradDeferral* d) : prev_(g_active_deferral) { g_active_deferral = d; }
WeightGradDeferral::Scope::~Scope() { g_active_deferral = prev_; }

void MoeLayer::backward(float* du_full, const float* dout_full, const float* u_full, const float* u_part,
                        TokenPart part, int64_t B, int64_t S) {
  kernels::Backend& be = *env_.be;
  Scratch& scratch = *env_.scratch;
  scratch.reset();
  const int64_t N = B * S, n = part.count, rows = n * k_;
  float* dYp = scratch.take(rows * H_);
  float* dw = scratch.take(n * k_);
  be.moe_combine_backward(dYp, dw, dout_full + part.first * H_, Yp_.data(), w_.data(), pos_.data(), n, k_, H_);
  float* dMp = scratch.take(rows * I_);
  float* dGUp = scratch.take(rows * 2 * I_);
  float* dXp = dYp;  // dYp is dead once dMp exists; same size [rows, H]
  Group dM, dWd;
  for (int64_t e = 0; e < E_; ++e) {
    if (!gate_up_[e] || counts_[e] == 0) continue;
    const int64_t o = offsets_[e], c = counts_[e];
    dM.add(dMp + o * I_, dYp + o * H_, down_[e].w, c, I_, H_);             // dMp = dYp W_d
    dWd.add(down_[e].g, dYp + o * H_, Mp_.data() + o * I_, H_, I_, c);     // dW_d += dYp^T Mp
  }
  be.gemm_grouped(dM.C.data(), dM.A.data(), dM.B.data(), dM.M.data(), dM.N.data(), dM.K.data(),
                  int64_t(dM.C.size()), false, false, 1.0f, 0.0f);
  env_.poll();
  run_weight_grads(be, dWd, dYp, rows * H_, Mp_.data(), rows * I_);
  env_.poll();
  be.swiglu_backward(dGUp, dMp, GUp_.data(), rows, I_);
  Group dX, dWgu;
  for (int64_t e = 0; e < E_; ++e) {
    if (!gate_up_[e] || counts_[e] == 0) continue;
    const int64_t o = offsets_[e], c = counts_[e];
    dX.add(dXp + o * H_, dGUp + o * 2 * I_, gate_up_[e].w, c, H_, 2 * I_);   // dXp = dGUp W_gu
    dWgu.add(gate_up_[e].g, dGUp + o * 2 * I_, Xp_.data() + o * H_, 2 * I_, H_, c);
  }
  be.gemm_grouped(dX.C.data(), dX.A.data(), dX.B.data(), dX.M.data(), dX.N.data(), dX.K.data(),
                  int64_t(dX.C.size()), false, false, 1.0f, 0.0f);
  env_.poll();
  run_weight_grads(be, dWgu, dGUp, rows * 2 * I_, Xp_.data(), rows * H_);
  env_.poll();
  if (shared_) shared_->backward(du_full, dout_full, u_full, N, 0.0f);
  else be.fill(du_full, 0.0f, N * H_);
  float* du_part = du_full + part.first * H_;
  be.moe_dispatch_backward(du_part, dXp, pos_.data(), n, k_, H_);
  float* dlogits = scratch.take(n * E_);
  be.router_backward(dlogits, dw, dscores_.data(), scores_.data(), idx_.data(), n, rp_);
  if (env_.tp_size == 1) {
    linear_backward(be, du_part, gate_.g, dlogits, u_part, gate_.w, n, E_, H_, 1.0f);
  } else {  // the router is replicated: its gradient from this rank's tokens, summed over the ranks
    float* dgate = scratch.take(E_ * H_);
    be.fill(dgate, 0.0f, E_ * H_);
    const WeightGradDeferral::Scope now(nullptr);  // reduced at once: never deferred
    linear_backward(be, du_part, dgate, dlogits, u_part, gate_.w, n, E_, H_, 1.0f);
    env_.coll->tp_all_reduce(dgate, E_ * H_);
    be.add(gate_.g, dgate, E_ * H_);
  }
  env_.poll();
}

void update_router_bias(float* bias, const int64_t* loads, int64_t E, float gamma) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += double(loads[e]) / double(E);
  for (int64_t e = 0; e < E; ++e) {
    const double diff = mean - double(loads[e]);
    bias[e] += gamma * float((diff > 0) - (diff < 0));
  }
}

}  // namespace dstrain::model
