#include "engine/model/deepseek_model.h"

#include <fmt/format.h>

#include <algorithm>

namespace dstrain::model {

// ---- decoder layer ---------------------------------------------------------------------------

DecoderLayer::DecoderLayer(const LayerEnv& env, int64_t index, int64_t B, int64_t S,
                           const RopeTables* rope)
    : env_(env), H_(env.cfg->hidden_size), eps_(float(env.cfg->rms_norm_eps)),
      attn_(env, fmt::format("model.layers.{}.", index), B, S, rope) {
  const std::string prefix = fmt::format("model.layers.{}.", index);
  in_norm_.bind(*env.params, prefix + "input_layernorm.weight");
  post_norm_.bind(*env.params, prefix + "post_attention_layernorm.weight");
  if (env.cfg->is_moe_layer(index))
    moe_ = std::make_unique<MoeLayer>(env, prefix, B, S);
  else
    mlp_ = std::make_unique<SwiGluMlp>(env, prefix + "mlp.", env.cfg->intermediate_size / env.tp_size, B * S);
  const int64_t N = B * S;
  a_.resize(N * H_), rstd1_.resize(N), h_mid_.resize(N * H_), u_.resize(N * H_), rstd2_.resize(N);
}

int64_t DecoderLayer::saved_floats() const {
  return int64_t(a_.size() + rstd1_.size() + h_mid_.size() + u_.size() + rstd2_.size()) +
         attn_.saved_floats() + (moe_ ? moe_->saved_floats() : mlp_->saved_floats());
}

int64_t DecoderLayer::scratch_floats(int64_t N) const {
  return std::max(attn_.scratch_floats(N), moe_ ? moe_->scratch_floats(N) : mlp_->scratch_floats(N));
}

void DecoderLayer::forward(float* h_out, const float* h_in, int64_t B, int64_t S,
                           const LossScale& scale) {
  kernels::Backend& be = *env_.be;
  const int64_t N = B * S;
  be.rmsnorm_forward(a_.data(), rstd1_.data(), h_in, in_norm_.w, N, H_, eps_);
  attn_.forward(h_mid_.data(), a_.data(), B, S);
  be.add(h_mid_.data(), h_in, N * H_);
  be.rmsnorm_forward(u_.data(), rstd2_.data(), h_mid_.data(), post_norm_.w, N, H_, eps_);
  if (moe_) moe_->forward(h_out, u_.data(), B, S, scale);
  else mlp_->forward(h_out, u_.data(), N);
  be.add(h_out, h_mid_.data(), N * H_);
}

void DecoderLayer::backward(float* dh, const float* h_in, int64_t B, int64_t S, float* tmp1,
                            float* tmp2) {
  kernels::Backend& be = *env_.be;
  const int64_t N = B * S;
  env_.scratch->reset();
  if (moe_) moe_->backward(tmp1, dh, u_.data(), B, S);
  else mlp_->backward(tmp1, dh, u_.data(), N, 0.0f);
  env_.poll();
  be.rmsnorm_backward(tmp2, post_norm_.g, tmp1, h_mid_.data(), post_norm_.w, rstd2_.data(), N, H_);
  be.add(dh, tmp2, N * H_);  // dL/dh_mid
  attn_.backward(tmp1, dh, a_.data(), B, S);
  env_.poll();
  be.rmsnorm_backward(tmp2, in_norm_.g, tmp1, h_in, in_norm_.w, rstd1_.data(), N, H_);
  be.add(dh, tmp2, N * H_);  // dL/dh_in
}

// ---- multi-token prediction (docs/model.md §3.8) ---------------------------------------------------

struct DeepSeekModel::Mtp {
  int64_t depth = 1, n = 0;  // module k, sequence length S - k
  WeightRef enorm, hnorm, eh_proj, head_norm;
  std::unique_ptr<DecoderLayer> layer;
  std::vector<int32_t> ids, targets;
  std::vector<float> e, en, rstd_e, hprev, hn, rstd_h, cat, m, h, z, rstd_z, logits, loss_rows, dh;

  Mtp(const LayerEnv& env, int64_t k, int64_t B, int64_t S, const RopeTables* rope) : depth(k), n(S - k) {
    const config::ModelConfig& c = *env.cfg;
    const int64_t index = c.num_hidden_layers + k - 1, H = c.hidden_size, rows = B * n;
    const std::string p = fmt::format("model.layers.{}.", index);
    enorm.bind(*env.params, p + "enorm.weight");
    hnorm.bind(*env.params, p + "hnorm.weight");
    eh_proj.bind(*env.params, p + "eh_proj.weight");
    head_norm.bind(*env.params, p + "shared_head.norm.weight");
    layer = std::make_unique<DecoderLayer>(env, index, B, n, rope);
    ids.resize(rows), targets.resize(rows);
    for (auto* v : {&e, &en, &hprev, &hn, &m, &h, &z, &dh}) v->resize(rows * H);
    rstd_e.resize(rows), rstd_h.resize(rows), rstd_z.resize(rows), loss_rows.resize(rows);
    cat.resize(rows * 2 * H);
    logits.resize(rows * c.vocab_size);
  }
  int64_t saved_floats() const {
    int64_t total = layer->saved_floats();
    for (auto* v : {&e, &en, &rstd_e, &hprev, &hn, &rstd_h, &cat, &m, &h, &z, &rstd_z, &logits})
      total += int64_t(v->size());
    return total;
  }
};

// ---- model -----------------------------------------------------------------------------------

DeepSeekModel::DeepSeekModel(const config::ModelConfig& cfg, kernels::Backend& be,
                             Collectives& coll, ParamStore& params, int64_t B, int64_t S, int tp_size)
    : cfg_(cfg), be_(be), rope_(make_rope_tables(cfg, S)), B_(B), S_(S), H_(cfg.hidden_size),
      V_(cfg.vocab_size), L_(cfg.num_hidden_layers) {
  DS_CHECK(tp_size == 1 || cfg.vocab_size % tp_size == 0, "vocab");
  const int64_t N = B * S;
  be_.reserve_attention(S);  // the attention kernels' scratch, once (MTP modules run shorter sequences)
  ones_.assign(N, 1.0f);
  env_ = LayerEnv{&cfg_, &be_, &coll, &params, &scratch_, ones_.data(), &progress_, tp_size};
  embed_.bind(params, "model.embed_tokens.weight");
  norm_.bind(params, "model.norm.weight");
  lm_head_.bind(params, "lm_head.weight");
  int64_t scratch = 0;
  for (int64_t i = 0; i < L_; ++i) {
    layers_.push_back(std::make_unique<DecoderLayer>(env_, i, B, S, &rope_));
    scratch = std::max(scratch, layers_.back()->scratch_floats(N));
  }
  for (int64_t k = 1; k <= cfg.num_nextn_predict_layers; ++k) {
    DS_CHECK(S - k >= 1, "MTP depth {} needs seq_length > {}", k, k);
    mtp_.push_back(std::make_unique<Mtp>(env_, k, B, S, &rope_));
    scratch = std::max({scratch, mtp_.back()->layer->scratch_floats(N), 2 * N * H_ + 64});
  }
  scratch_.reserve(scratch);
  ids_.resize(N), targets_.resize(N);
  hidden_.assign(L_ + 1, std::vector<float>(N * H_));
  z_.resize(N * H_), rstd_f_.resize(N), logits_.resize(N * V_), loss_rows_.resize(N);
  dz_.resize(N * H_), dh_.resize(N * H_), tmp1_.resize(N * H_), tmp2_.resize(N * H_);
}

DeepSeekModel::~DeepSeekModel() = default;

std::vector<MoeLayer*> DeepSeekModel::moe_layers() {
  std::vector<MoeLayer*> out;
  for (auto& l : layers_)
    if (l->moe()) out.push_back(l->moe());
  for (auto& m : mtp_)
    if (m->layer->moe()) out.push_back(m->layer->moe());
  return out;
}

int64_t DeepSeekModel::saved_activation_bytes() const {
  int64_t floats = int64_t(z_.size() + rstd_f_.size() + logits_.size()) + int64_t(ids_.size() * 2);
  for (const auto& h : hidden_) floats += int64_t(h.size());
  for (const auto& l : layers_) floats += l->saved_floats();
  for (const auto& m : mtp_) floats += m->saved_floats();
  return floats * int64_t(sizeof(float));
}

int64_t DeepSeekModel::workspace_bytes() const {
  return (scratch_.capacity() + int64_t(dz_.size() + dh_.size() + tmp1_.size() + tmp2_.size() + ones_.size() +
                                        loss_rows_.size())) *
         int64_t(sizeof(float));
}

double DeepSeekModel::head_loss(float* logits, const float* h, float* z, float* rstd,
                                const WeightRef& norm, const int32_t* targets, int64_t rows,
                                double grad_scale) {
  be_.rmsnorm_forward(z, rstd, h, norm.w, rows, H_, float(cfg_.rms_norm_eps));
  linear_forward(be_, logits, z, lm_head_.w, rows, V_, H_);
  if (keep_logits_ && logits == logits_.data()) kept_logits_.assign(logits, logits + rows * V_);
  be_.cross_entropy(loss_rows_.data(), logits, targets, rows, V_, float(grad_scale));
  double sum = 0;
  for (int64_t r = 0; r < rows; ++r) sum += loss_rows_[r];
  return sum * grad_scale;
}

Losses DeepSeekModel::forward(const int32_t* tokens, const LossScale& scale) {
  const int64_t N = B_ * S_;
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < S_; ++t) {
      ids_[b * S_ + t] = tokens[b * (S_ + 1) + t];
      targets_[b * S_ + t] = tokens[b * (S_ + 1) + t + 1];
    }
  for (auto* moe : moe_layers()) moe->stats().aux_loss = 0.0;
  be_.embedding_forward(hidden_[0].data(), embed_.w, ids_.data(), N, H_);
  for (int64_t i = 0; i < L_; ++i)
    layers_[i]->forward(hidden_[i + 1].data(), hidden_[i].data(), B_, S_, scale);
  Losses out;
  out.ce = head_loss(logits_.data(), hidden_[L_].data(), z_.data(), rstd_f_.data(), norm_,
                     targets_.data(), N, 1.0 / scale.tokens);
  if (!mtp_.empty()) mtp_forward(tokens, scale, out);
  for (auto* moe : moe_layers()) out.aux += moe->stats().aux_loss;
  return out;
}

void DeepSeekModel::mtp_forward(const int32_t* tokens, const LossScale& scale, Losses& out) {
  const double lambda = cfg_.mtp_loss_weight / double(mtp_.size());
  for (size_t k = 0; k < mtp_.size(); ++k) {
    Mtp& m = *mtp_[k];
    const int64_t n = m.n, rows = B_ * n, depth = m.depth;
    const float* prev = k == 0 ? z_.data() : mtp_[k - 1]->h.data();
    const int64_t prev_len = n + 1;  // S for the first module, S - (k - 1) after
    for (int64_t b = 0; b < B_; ++b) {
      be_.copy_strided(m.hprev.data() + b * n * H_, H_, prev + b * prev_len * H_, H_, n, H_);
      for (int64_t i = 0; i < n; ++i) {
        m.ids[b * n + i] = tokens[b * (S_ + 1) + i + depth];
        m.targets[b * n + i] = tokens[b * (S_ + 1) + i + depth + 1];
      }
    }
    const float eps = float(cfg_.rms_norm_eps);
    be_.embedding_forward(m.e.data(), embed_.w, m.ids.data(), rows, H_);
    be_.rmsnorm_forward(m.en.data(), m.rstd_e.data(), m.e.data(), m.enorm.w, rows, H_, eps);
    be_.rmsnorm_forward(m.hn.data(), m.rstd_h.data(), m.hprev.data(), m.hnorm.w, rows, H_, eps);
    be_.copy_strided(m.cat.data(), 2 * H_, m.en.data(), H_, rows, H_);  // [enorm(e) ; hnorm(h)]
    be_.copy_strided(m.cat.data() + H_, 2 * H_, m.hn.data(), H_, rows, H_);
    linear_forward(be_, m.m.data(), m.cat.data(), m.eh_proj.w, rows, H_, 2 * H_);
    m.layer->forward(m.h.data(), m.m.data(), B_, n, scale);
    const double grad_scale = lambda / (scale.sequences * double(n));
    out.mtp += head_loss(m.logits.data(), m.h.data(), m.z.data(), m.rstd_z.data(), m.head_norm,
                         m.targets.data(), rows, grad_scale);
  }
}

void DeepSeekModel::backward() {
  const int64_t N = B_ * S_;
  // Head: dz = dlogits W_lm, dW_lm += dlogits^T z; MTP adds its gradient of h^0 = z.
  linear_backward(be_, dz_.data(), lm_head_.g, logits_.data(), z_.data(), lm_head_.w, N, V_, H_);
  progress_.poll();
  if (!mtp_.empty()) mtp_backward(dz_.data());
  be_.rmsnorm_backward(dh_.data(), norm_.g, dz_.data(), hidden_[L_].data(), norm_.w,
                       rstd_f_.data(), N, H_);
  // The head and the MTP modules (which share lm_head) are final together.
  const int64_t D = int64_t(mtp_.size());
  for (int64_t l = L_ + D; l >= L_; --l) progress_.grads_final(l);
  for (int64_t i = L_ - 1; i >= 0; --i) {
    layers_[i]->backward(dh_.data(), hidden_[i].data(), B_, S_, tmp1_.data(), tmp2_.data());
    progress_.grads_final(i);
  }
  be_.embedding_backward(embed_.g, dh_.data(), ids_.data(), N, H_, V_);
  progress_.grads_final(-1);
}

std::vector<int64_t> DeepSeekModel::backward_order(const config::ModelConfig& cfg) {
  const int64_t L = cfg.num_hidden_layers, D = cfg.num_nextn_predict_layers;
  std::vector<int64_t> order;
  for (int64_t l = L + D; l >= -1; --l) order.push_back(l);  // head, MTP L+D-1 ... L, L-1 ... 0, -1
  return order;
}

void DeepSeekModel::mtp_backward(float* dz) {
  for (auto& m : mtp_) be_.fill(m->dh.data(), 0.0f, int64_t(m->dh.size()));
  for (int64_t k = int64_t(mtp_.size()) - 1; k >= 0; --k) {
    Mtp& m = *mtp_[k];
    const int64_t n = m.n, rows = B_ * n;
    // Its own head, then the gradient module k+1 left in m.dh.
    linear_backward(be_, tmp1_.data(), lm_head_.g, m.logits.data(), m.z.data(), lm_head_.w, rows, V_, H_);
    be_.rmsnorm_backward(tmp2_.data(), m.head_norm.g, tmp1_.data(), m.h.data(), m.head_norm.w,
                         m.rstd_z.data(), rows, H_);
    be_.add(m.dh.data(), tmp2_.data(), rows * H_);
    m.layer->backward(m.dh.data(), m.m.data(), B_, n, tmp1_.data(), tmp2_.data());  // m.dh = dL/dm
    scratch_.reset();
    float* dcat = scratch_.take(rows * 2 * H_);
    linear_backward(be_, dcat, m.eh_proj.g, m.dh.data(), m.cat.data(), m.eh_proj.w, rows, H_, 2 * H_);
    // Embedding half: enorm backward, then into the shared embedding table.
    be_.copy_strided(tmp1_.data(), H_, dcat, 2 * H_, rows, H_);
    be_.rmsnorm_backward(tmp2_.data(), m.enorm.g, tmp1_.data(), m.e.data(), m.enorm.w,
                         m.rstd_e.data(), rows, H_);
    be_.embedding_backward(embed_.g, tmp2_.data(), m.ids.data(), rows, H_, V_);
    // Hidden half: hnorm backward, then into the first n positions of the previous hidden state.
    be_.copy_strided(tmp1_.data(), H_, dcat + H_, 2 * H_, rows, H_);
    be_.rmsnorm_backward(tmp2_.data(), m.hnorm.g, tmp1_.data(), m.hprev.data(), m.hnorm.w,
                         m.rstd_h.data(), rows, H_);
    float* dprev = k == 0 ? dz : mtp_[k - 1]->dh.data();
    const int64_t prev_len = n + 1;
    for (int64_t b = 0; b < B_; ++b)
      be_.add_strided(dprev + b * prev_len * H_, H_, tmp2_.data() + b * n * H_, H_, n, H_);
  }
}

}  // namespace dstrain::model
