#include "engine/model/mla.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace dstrain::model {

namespace {
double yarn_m(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}
}  // namespace

RopeTables make_rope_tables(const config::ModelConfig& m, int64_t S, kernels::Backend& be) {
  const int64_t dr = m.qk_rope_head_dim, half = dr / 2;
  std::vector<float> inv_freq(half);
  for (int64_t j = 0; j < half; ++j)
    inv_freq[j] = 1.0f / std::pow(float(m.rope_theta), float(2 * j) / float(dr));
  RopeTables t;
  t.attention_scale = float(1.0 / std::sqrt(double(m.qk_head_dim())));
  float magnitude = 1.0f;
  if (m.rope_scaling) {  // YaRN (docs/model.md §3.4.1)
    const config::RopeScaling& y = *m.rope_scaling;
    const double base = m.rope_theta, L0 = double(y.original_max_position_embeddings);
    const auto dim = [&](double n) { return dr * std::log(L0 / (2 * M_PI * n)) / (2 * std::log(base)); };
    double low = std::max(std::floor(dim(y.beta_fast)), 0.0);
    double high = std::min(std::ceil(dim(y.beta_slow)), double(dr - 1));
    if (low == high) high += 0.001;
    for (int64_t j = 0; j < half; ++j) {
      const double ramp = std::clamp((double(j) - low) / (high - low), 0.0, 1.0);
      inv_freq[j] = float(inv_freq[j] / y.factor * ramp + inv_freq[j] * (1.0 - ramp));
    }
    magnitude = float(yarn_m(y.factor, y.mscale) / yarn_m(y.factor, y.mscale_all_dim));
    const double ms = yarn_m(y.factor, y.mscale_all_dim);
    t.attention_scale = float(t.attention_scale * ms * ms);
  }
  std::vector<float> cos(size_t(S * half)), sin(size_t(S * half));
  for (int64_t p = 0; p < S; ++p)
    for (int64_t j = 0; j < half; ++j) {
      const float angle = float(p) * inv_freq[j];
      cos[size_t(p * half + j)] = std::cos(angle) * magnitude;
      sin[size_t(p * half + j)] = std::sin(angle) * magnitude;
    }
  t.cos.resize(be, S * half), t.sin.resize(be, S * half);
  be.copy_from_host(t.cos.data(), cos.data(), S * half * int64_t(sizeof(float)));
  be.copy_from_host(t.sin.data(), sin.data(), S * half * int64_t(sizeof(float)));
  return t;
}

MlaAttention::MlaAttention(const LayerEnv& env, const std::string& prefix, int64_t B, int64_t S,
                           const RopeTables* rope)
    : env_(env), rope_(rope) {
  const config::ModelConfig& m = *env.cfg;
  H_ = m.hidden_size, nh_ = env.heads(), dn_ = m.qk_nope_head_dim, dr_ = m.qk_rope_head_dim;
  dv_ = m.v_head_dim, dqk_ = dn_ + dr_, rkv_ = m.kv_lora_rank;
  lora_ = m.q_lora_rank.has_value();
  rq_ = m.q_lora_rank.value_or(0);
  ParamStore& p = *env.params;
  const std::string a = prefix + "self_attn.";
  if (lora_) {
    q_a_ = Linear(p, a + "q_a_proj.weight");
    q_a_norm_.bind(p, a + "q_a_layernorm.weight");
    q_b_ = Linear(p, a + "q_b_proj.weight");
  } else {
    q_ = Linear(p, a + "q_proj.weight");
  }
  const Linear kv_a(p, a + "kv_a_proj_with_mqa.weight");
  ckv_proj_ = kv_a.rows(0, rkv_), kpe_proj_ = kv_a.rows(rkv_, dr_);
  kv_a_norm_.bind(p, a + "kv_a_layernorm.weight");
  kv_b_ = Linear(p, a + "kv_b_proj.weight");
  o_ = Linear(p, a + "o_proj.weight");
  // What the block assumes of each split (docs/model.md §10.1): the query and KV up-projections
  // split by heads (column-parallel), o_proj's output a partial sum (row-parallel), the low-rank
  // down-projections replicated.
  DS_CHECK((lora_ ? q_b_ : q_).split() == plan::Shard::kColumn && kv_b_.split() == plan::Shard::kColumn &&
               o_.split() == plan::Shard::kRow && kv_a.split() == plan::Shard::kReplicated &&
               (!lora_ || q_a_.split() == plan::Shard::kReplicated),
           "{}: the parameter table splits its projections differently from MLA's tensor parallelism", a);
  if (m.attention_bias) {
    if (lora_) q_a_bias_.bind(p, a + "q_a_proj.bias");
    kv_a_bias_.bind(p, a + "kv_a_proj_with_mqa.bias");
    o_bias_.bind(p, a + "o_proj.bias");
  }
  const int64_t N = B * S;
  ActivationStore& st = *env.acts;
  // Under bf16 / fp16 what only GEMMs read is kept in the compute type: the normed latents and
  // Q, K, V (docs/design.md §6.10).
  const kernels::DType lp = gemm_input_dtype(env);
  cq_ = st.take(N * rq_), rstd_q_ = st.take(lora_ ? N : 0), cqn_ = st.take(N * rq_, true, lp);
  ckv_ = st.take(N * rkv_), kpe_ = st.take(N * dr_), rstd_kv_ = st.take(N), ckvn_ = st.take(N * rkv_, true, lp);
  Q_ = st.take(N * nh_ * dqk_, false, lp), K_ = st.take(N * nh_ * dqk_, false, lp), V_ = st.take(N * nh_ * dv_, false, lp);
  O_ = st.take(N * nh_ * dv_, true), lse_ = st.take(N * nh_, true);
}

// A normed latent (cqn or ckvn) into its saved buffer, in its type (16-bit: rounded by the op).
void MlaAttention::norm_latent(const ActBuf& out, float* rstd, const float* x, const float* w, int64_t N, int64_t d) {
  env_.be->rmsnorm_forward({out.view(), {N, d}}, {rstd, {N}}, {x, {N, d}}, {w, {d}}, 1e-6f);
}

void MlaAttention::recompute_selective(int64_t B, int64_t S) {
  const int64_t N = B * S;
  env_.scratch->reset();
  if (lora_) norm_latent(cqn_, rstd_q_.data(), cq_.data(), q_a_norm_.w, N, rq_);
  norm_latent(ckvn_, rstd_kv_.data(), ckv_.data(), kv_a_norm_.w, N, rkv_);
  attention_core(B, S);
}

// Q, K, V as the attention kernels read them: the saved buffers, in the compute type under
// bf16 / fp16 — or, where the backend has no 16-bit attention for that type, widened back to
// fp32 into scratch (the same rounded values, fp32 kernels: docs/design.md §6.10).
std::array<kernels::ConstView, 3> MlaAttention::qkv_for_attention() {
  const ActBuf* b[3] = {&Q_, &K_, &V_};
  std::array<kernels::ConstView, 3> out;
  const bool widen = Q_.dtype() != kernels::DType::kF32 && !env_.be->low_precision_attention(Q_.dtype());
  for (int i = 0; i < 3; ++i) {
    out[size_t(i)] = {b[i]->raw(), b[i]->dtype()};
    if (!widen) continue;
    float* w = env_.scratch->take(b[i]->size());
    env_.be->convert({w, kernels::DType::kF32, {b[i]->size()}}, {out[size_t(i)], {b[i]->size()}});
    out[size_t(i)] = kernels::f32(w);
  }
  return out;
}

void MlaAttention::attention_core(int64_t B, int64_t S) {
  const auto [q, k, v] = qkv_for_attention();
  const kernels::Dims qk{B, S, nh_, dqk_}, vo{B, S, nh_, dv_};
  env_.be->attention_forward({O_.data(), vo}, {lse_.data(), {B, nh_, S}}, {q, qk}, {k, qk}, {v, vo},
                             rope_->attention_scale);
}

int64_t MlaAttention::scratch_floats(int64_t N) const {
  // backward: dO, dQ, dK, dV, dkv, dkpe, dckvn, dckv, dq, dcqn, dcq (+ alignment slack); the
  // forward's staging (q, kv, Q, K, V, a normed latent) takes less. Q, K, V widened for fp32
  // attention kernels (a 16-bit type the backend has no attention for) come on top.
  const bool widen = Q_.dtype() != kernels::DType::kF32 && !env_.be->low_precision_attention(Q_.dtype());
  return N * (nh_ * dv_ * 2 + nh_ * dqk_ * 3 + nh_ * (dn_ + dv_) + dr_ + 2 * rkv_ + 2 * rq_ +
              (lora_ ? 0 : H_) + (widen ? nh_ * (2 * dqk_ + dv_) : 0)) +
         16 * 15;
}

void MlaAttention::forward(float* out, const float* a, int64_t B, int64_t S) {
  kernels::Backend& be = *env_.be;
  const int64_t N = B * S, kv_w = dn_ + dv_;
  Scratch& scratch = *env_.scratch;
  scratch.reset();
  // Query: q = RMSNorm(a W_qa^T) W_qb^T (or a W_q^T), [N, nh*dqk], then Q = [q_nope ; rope(q_pe)].
  float* q = scratch.take(N * nh_ * dqk_);
  const GemmInput ain = ckv_proj_.pin(env_, a, N);  // a feeds three GEMMs: rounded once
  if (lora_) {
    q_a_.forward(env_, cq_.data(), ain, N);
    if (q_a_bias_) bias_forward(be, cq_.data(), q_a_bias_.w, N, rq_);
    norm_latent(cqn_, rstd_q_.data(), cq_.data(), q_a_norm_.w, N, rq_);
    q_b_.forward(env_, q, GemmInput::saved(cqn_), N);
  } else {
    q_.forward(env_, q, ain, N);
  }
  // Q, K, V are written straight into their saved buffers, in 16 bits under bf16 / fp16 (each
  // value rounded as a conversion of the fp32 one would: docs/design.md §6.10).
  // A head's row is [nope (dn) | rope (dr)]: the rope parts are [N, nh, dr], heads dqk apart.
  const kernels::View Qv = Q_.view();
  const kernels::Dims nope{N * nh_, dn_}, rope{N, nh_, dr_}, heads{nh_ * dqk_, dqk_, 1};
  const kernels::ConstTensor rcos{rope_->cos.data(), {S, dr_ / 2}}, rsin{rope_->sin.data(), {S, dr_ / 2}};
  const bool interleave = env_.cfg->rope_interleave;
  be.copy_strided({Qv, nope, {dqk_, 1}}, {q, nope, {dqk_, 1}});
  be.rope_forward({kernels::offset_view(Qv, dn_), rope, heads}, {q + dn_, rope, heads}, rcos, rsin, interleave);
  // Compressed KV: c_kv = a W_kva[:r_kv]^T, k_pe = a W_kva[r_kv:]^T (two GEMMs on row blocks).
  ckv_proj_.forward(env_, ckv_.data(), ain, N);
  kpe_proj_.forward(env_, kpe_.data(), ain, N);
  if (kv_a_bias_) {
    bias_forward(be, ckv_.data(), kv_a_bias_.w, N, rkv_);
    bias_forward(be, kpe_.data(), kv_a_bias_.w + rkv_, N, dr_);
  }
  norm_latent(ckvn_, rstd_kv_.data(), ckv_.data(), kv_a_norm_.w, N, rkv_);
  float* kv = scratch.take(N * nh_ * kv_w);
  kv_b_.forward(env_, kv, GemmInput::saved(ckvn_), N);
  const kernels::View Kv = K_.view();
  be.copy_strided({Kv, nope, {dqk_, 1}}, {kv, nope, {kv_w, 1}});
  be.copy_strided({V_.view(), {N * nh_, dv_}}, {kv + dn_, {N * nh_, dv_}, {kv_w, 1}});
  // One rope key for all heads: head stride 0 on the input broadcasts it.
  be.rope_forward({kernels::offset_view(Kv, dn_), rope, heads}, {kpe_.data(), rope, {dr_, 0, 1}}, rcos, rsin,
                  interleave);
  attention_core(B, S);
  o_.forward(env_, out, O_.data(), N);  // row-parallel: this rank's heads' part
}

void MlaAttention::add_output_bias(float* x, int64_t rows) {
  if (o_bias_) bias_forward(*env_.be, x, o_bias_.w, rows, H_);
}

void MlaAttention::backward(float* da, const float* dout, const float* a, int64_t B, int64_t S) {
  kernels::Backend& be = *env_.be;
  const int64_t N = B * S, kv_w = dn_ + dv_;
  Scratch& scratch = *env_.scratch;
  scratch.reset();
  if (o_bias_) bias_backward(be, o_bias_.g, dout, env_.ones, N, H_);
  float* dO = scratch.take(N * nh_ * dv_);
  o_.backward(env_, dO, dout, O_.data(), N);
  float* dQ = scratch.take(N * nh_ * dqk_);
  float* dK = scratch.take(N * nh_ * dqk_);
  float* dV = scratch.take(N * nh_ * dv_);
  env_.poll();
  {
    const auto [q, k, v] = qkv_for_attention();
    const kernels::ConstView dOc = q.dtype == kernels::DType::kF32 ? kernels::f32(dO) : (*env_.cast)(kPinned, dO, N * nh_ * dv_);
    const kernels::Dims qk{B, S, nh_, dqk_}, vo{B, S, nh_, dv_};
    be.attention_backward({dQ, qk}, {dK, qk}, {dV, vo}, {dO, vo}, {dOc, vo}, {q, qk}, {k, qk}, {v, vo}, {O_.data(), vo},
                          {lse_.data(), {B, nh_, S}}, rope_->attention_scale);
  }
  // KV branch: dkv = [dk_nope | dv] per head; dk_pe sums the rope-inverted keys over heads.
  // Where kv_b_proj's GEMMs take it in 16 bits, dkv is written in 16 bits into the GEMMs' input
  // slot (the same values a conversion of the fp32 array gives: docs/design.md §6.10); so is dq.
  const bool dkv_lp = kv_b_.dy_in_16bit(env_);
  float* dkv = dkv_lp ? nullptr : scratch.take(N * nh_ * kv_w);
  const kernels::View dkvv = dkv_lp ? env_.cast->slot_view(0, N * nh_ * kv_w) : kernels::View{dkv, kernels::DType::kF32};
  const kernels::Dims nope{N * nh_, dn_}, rope{N, nh_, dr_}, heads{nh_ * dqk_, dqk_, 1};
  const kernels::ConstTensor rcos{rope_->cos.data(), {S, dr_ / 2}}, rsin{rope_->sin.data(), {S, dr_ / 2}};
  const bool interleave = env_.cfg->rope_interleave;
  be.copy_strided({dkvv, nope, {kv_w, 1}}, {dK, nope, {dqk_, 1}});
  be.copy_strided({kernels::offset_view(dkvv, dn_), {N * nh_, dv_}, {kv_w, 1}}, {dV, {N * nh_, dv_}});
  // The gradients of the replicated low-rank activations, adjacent so that one all-reduce sums
  // them over the tensor-parallel ranks: [dckvn | dkpe | dcqn].
  const int64_t latent = N * (rkv_ + dr_ + (lora_ ? rq_ : 0));
  float* dckvn = scratch.take(latent);
  float* dkpe = dckvn + N * rkv_;
  float* dcqn = lora_ ? dkpe + N * dr_ : nullptr;
  be.fill({dkpe, {N * dr_}}, 0.0f);
  be.rope_backward({dkpe, rope, {dr_, 0, 1}}, {dK + dn_, rope, heads}, rcos, rsin, interleave, true);
  env_.poll();
  kv_b_.backward(env_, dckvn, dkv_lp ? GemmInput::rounded({dkvv.data, dkvv.dtype}) : GemmInput(dkv),
                 GemmInput::saved(ckvn_), N);
  const GemmInput ain = ckv_proj_.pin(env_, a, N);  // the weight GEMMs' common input
  // Query branch: dq = [dq_nope | rope^-1(dq_pe)] (slot 0 is free again: kv_b_proj's GEMMs ran),
  // consumed at once by its projection's backward, before another GEMM reuses the slot.
  const Linear& Wq = lora_ ? q_b_ : q_;
  const bool dq_lp = Wq.dy_in_16bit(env_);
  float* dq = dq_lp ? nullptr : scratch.take(N * nh_ * dqk_);
  const kernels::View dqv = dq_lp ? env_.cast->slot_view(0, N * nh_ * dqk_) : kernels::View{dq, kernels::DType::kF32};
  const GemmInput dqin = dq_lp ? GemmInput::rounded({dqv.data, dqv.dtype}) : GemmInput(dq);
  be.copy_strided({dqv, nope, {dqk_, 1}}, {dQ, nope, {dqk_, 1}});
  be.rope_backward({kernels::offset_view(dqv, dn_), rope, heads}, {dQ + dn_, rope, heads}, rcos, rsin, interleave,
                   false);
  float* daq = nullptr;  // column-parallel q_proj (no query LoRA): its partial input gradient
  if (lora_) {
    q_b_.backward(env_, dcqn, dqin, GemmInput::saved(cqn_), N);
  } else {
    daq = scratch.take(N * H_);
    q_.backward(env_, daq, dqin, ain, N);
  }
  // Head-sharded compute gave partial gradients of the replicated activations (docs/model.md §10.1).
  env_.coll->tp_all_reduce(dckvn, latent);
  float* dckv = scratch.take(N * rkv_);
  be.rmsnorm_backward({dckv, {N, rkv_}}, {kv_a_norm_.g, {rkv_}}, {dckvn, {N, rkv_}}, {ckv_.data(), {N, rkv_}},
                      {kv_a_norm_.w, {rkv_}}, {rstd_kv_.data(), {N}});
  if (kv_a_bias_) {
    bias_backward(be, kv_a_bias_.g, dckv, env_.ones, N, rkv_);
    bias_backward(be, kv_a_bias_.g + rkv_, dkpe, env_.ones, N, dr_);
  }
  env_.poll();
  ckv_proj_.backward(env_, da, dckv, ain, N);
  kpe_proj_.backward(env_, da, dkpe, ain, N, 1.0f);
  env_.poll();
  if (lora_) {
    float* dcq = scratch.take(N * rq_);
    be.rmsnorm_backward({dcq, {N, rq_}}, {q_a_norm_.g, {rq_}}, {dcqn, {N, rq_}}, {cq_.data(), {N, rq_}},
                        {q_a_norm_.w, {rq_}}, {rstd_q_.data(), {N}});
    if (q_a_bias_) bias_backward(be, q_a_bias_.g, dcq, env_.ones, N, rq_);
    q_a_.backward(env_, da, dcq, ain, N, 1.0f);
  } else {
    // q_proj's input gradient is partial over the tensor-parallel ranks: reduced alone, then added.
    env_.coll->tp_all_reduce(daq, N * H_);
    be.add({da, {N * H_}}, {daq, {N * H_}});
  }
}

}  // namespace dstrain::model
