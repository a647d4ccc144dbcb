#include "engine/model/deepseek_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "engine/common/trace.h"
#include "engine/plan/memory.h"
#include "engine/plan/param_table.h"

namespace dstrain::model {
namespace {
// n floats in a shared workspace array: grown (its contents lost), never shrunk.
void grow(kernels::DeviceArray<float>& a, kernels::Backend& be, int64_t n) {
  if (n > a.size()) a.resize(be, n);
}
}  // namespace

// ---- decoder layer ---------------------------------------------------------------------------

namespace {
// The layer's buffers are taken from the store from here on (before its members are built).
const LayerEnv& begin_layer(const LayerEnv& env, Recompute mode) {
  env.acts->begin_layer(mode);
  return env;
}
}  // namespace

DecoderLayer::DecoderLayer(const LayerEnv& env, int64_t index, int64_t B, int64_t S,
                           const RopeTables* rope, Recompute recompute)
    : env_(begin_layer(env, recompute)), recompute_(recompute), H_(env.cfg->hidden_size), N_(B * S),
      eps_(float(env.cfg->rms_norm_eps)), attn_(env, fmt::format("model.layers.{}.", index), B, S, rope) {
  const std::string prefix = fmt::format("model.layers.{}.", index);
  in_norm_.bind(*env.params, prefix + "input_layernorm.weight");
  post_norm_.bind(*env.params, prefix + "post_attention_layernorm.weight");
  if (env.cfg->is_moe_layer(index))
    moe_ = std::make_unique<MoeLayer>(env, prefix, B, S);
  else
    mlp_ = std::make_unique<SwiGluMlp>(env, prefix + "mlp.", env.cfg->intermediate_size / env.tp_size, N_);
  part_ = token_part(N_, env.tp_size, env.tp_rank);
  DS_CHECK(!env.sp || part_.count * env.tp_size == N_, "sequence parallelism needs equal token parts");
  rows_ = env.sp ? part_.count : N_;
  ActivationStore& st = *env.acts;
  a_ = st.take(rows_ * H_, true), rstd1_ = st.take(rows_), h_mid_ = st.take(rows_ * H_);
  u_ = st.take(rows_ * H_, true), rstd2_ = st.take(rows_);
  dw_.resize(*env.be, H_);
}

int64_t DecoderLayer::scratch_floats(int64_t N) const {
  return std::max(attn_.scratch_floats(N), moe_ ? moe_->scratch_floats(N) : mlp_->scratch_floats(N));
}

// This rank's rows, or all N rows gathered into `full` with sequence parallelism.
const float* DecoderLayer::gathered(const float* part, float* full) const {
  if (!env_.sp) return part;
  env_.coll->tp_all_gather_rows(full, part, rows_, H_);
  return full;
}

// `partial` [N,H]: this rank's part of a sum over the tensor-parallel ranks; `out`: the rows of
// the sum this rank holds — all of them (an all-reduce in place, out == partial), or its token
// part with sequence parallelism (a reduce-scatter).
void DecoderLayer::reduce_into(float* out, float* partial) const {
  if (env_.sp) {
    env_.coll->tp_reduce_scatter_rows(out, partial, rows_, H_);
  } else {
    env_.coll->tp_all_reduce(partial, N_ * H_);
    if (out != partial) std::copy(partial, partial + N_ * H_, out);
  }
}

// RMSNorm backward on this rank's rows. With sequence parallelism the weight's gradient comes
// from this rank's tokens only: the increment is summed over the ranks before it is added.
void DecoderLayer::norm_backward(float* dx, const WeightRef& w, const float* dy, const float* x,
                                 const float* rstd) {
  kernels::Backend& be = *env_.be;
  if (!env_.sp)
    return be.rmsnorm_backward({dx, {rows_, H_}}, {w.g, {H_}}, {dy, {rows_, H_}}, {x, {rows_, H_}}, {w.w, {H_}},
                               {rstd, {rows_}});
  be.fill({dw_.data(), {H_}}, 0.0f);
  be.rmsnorm_backward({dx, {rows_, H_}}, {dw_.data(), {H_}}, {dy, {rows_, H_}}, {x, {rows_, H_}}, {w.w, {H_}},
                      {rstd, {rows_}});
  env_.coll->tp_all_reduce(dw_.data(), H_);
  be.add({w.g, {H_}}, {dw_.data(), {H_}});
}

void DecoderLayer::forward(float* h_out, const float* h_in, int64_t B, int64_t S,
                           const LossScale& scale) {
  kernels::Backend& be = *env_.be;
  const int64_t n = rows_;
  scale_ = scale;
  if (recompute_ != Recompute::kNone) env_.acts->set_holder(this);
  be.rmsnorm_forward({a_.data(), {n, H_}}, {rstd1_.data(), {n}}, {h_in, {n, H_}}, {in_norm_.w, {H_}}, eps_);
  float* attn = env_.sp ? env_.full_at(1) : h_mid_.data();
  attn_.forward(attn, gathered(a_.data(), env_.full_at(0)), B, S);
  reduce_into(h_mid_.data(), attn);
  attn_.add_output_bias(h_mid_.data(), n);
  be.add({h_mid_.data(), {n * H_}}, {h_in, {n * H_}});
  be.rmsnorm_forward({u_.data(), {n, H_}}, {rstd2_.data(), {n}}, {h_mid_.data(), {n, H_}}, {post_norm_.w, {H_}}, eps_);
  const float* u_full = gathered(u_.data(), env_.full_at(0));
  float* ffn = env_.sp ? env_.full_at(1) : h_out;
  env_.scratch->reset();  // the attention's temporaries are dead
  if (moe_) moe_->forward(ffn, u_full, env_.sp ? u_.data() : u_full + part_.first * H_, part_, B, S, scale);
  else mlp_->forward(ffn, u_full, N_);
  reduce_into(h_out, ffn);
  be.add({h_out, {n * H_}}, {h_mid_.data(), {n * H_}});
}

// Rewrites what the layer did not keep, with the forward's kernels on the forward's inputs, so
// that backward reads the very bits a keeping layer would (docs/design.md §6.7). Under full
// recomputation the whole forward runs again (its collectives included, on every rank of the
// group alike), its output going to `h_out`, a work buffer.
void DecoderLayer::recompute(float* h_out, const float* h_in, int64_t B, int64_t S) {
  kernels::Backend& be = *env_.be;
  if (recompute_ == Recompute::kFull) {
    if (moe_) moe_->set_recomputing(true);
    forward(h_out, h_in, B, S, scale_);
    if (moe_) moe_->set_recomputing(false);
    return;
  }
  env_.acts->set_holder(this);
  be.rmsnorm_forward({a_.data(), {rows_, H_}}, {rstd1_.data(), {rows_}}, {h_in, {rows_, H_}}, {in_norm_.w, {H_}}, eps_);
  be.rmsnorm_forward({u_.data(), {rows_, H_}}, {rstd2_.data(), {rows_}}, {h_mid_.data(), {rows_, H_}},
                     {post_norm_.w, {H_}}, eps_);
  attn_.recompute_selective(B, S);
  env_.scratch->reset();
  if (moe_) moe_->recompute_selective(u_.data() + (env_.sp ? 0 : part_.first * H_), N_);
  else mlp_->recompute_selective(N_);
}

void DecoderLayer::backward(float* dh, const float* h_in, int64_t B, int64_t S, float* tmp1,
                            float* tmp2) {
  kernels::Backend& be = *env_.be;
  const int64_t n = rows_;
  // The last recomputing layer of a forward finds its own values still there (nothing wrote the
  // shared buffers since): no recomputation (docs/design.md §6.7).
  if (recompute_ != Recompute::kNone && env_.acts->holder() != this) recompute(tmp1, h_in, B, S);
  env_.scratch->reset();
  // Feed-forward block: the complete output gradient of all tokens, this rank's part of the
  // input gradient, summed over the ranks.
  const float* dout = gathered(dh, env_.full_at(2));
  const float* u_full = gathered(u_.data(), env_.full_at(0));
  float* du = env_.sp ? env_.full_at(1) : tmp1;
  if (moe_) moe_->backward(du, dout, u_full, env_.sp ? u_.data() : u_full + part_.first * H_, part_, B, S);
  else mlp_->backward(du, dout, u_full, N_, 0.0f);
  reduce_into(tmp1, du);
  env_.poll();
  norm_backward(tmp2, post_norm_, tmp1, h_mid_.data(), rstd2_.data());
  be.add({dh, {n * H_}}, {tmp2, {n * H_}});  // dL/dh_mid
  // Attention: its input gradient comes out complete (the low-rank activations' gradients are
  // summed inside), so with sequence parallelism this rank just takes its rows.
  const float* dmid = gathered(dh, env_.full_at(2));
  float* da = env_.sp ? env_.full_at(1) : tmp1;
  attn_.backward(da, dmid, gathered(a_.data(), env_.full_at(0)), B, S);
  env_.poll();
  norm_backward(tmp2, in_norm_, env_.sp ? da + part_.first * H_ : da, h_in, rstd1_.data());
  be.add({dh, {n * H_}}, {tmp2, {n * H_}});  // dL/dh_in
}

// ---- multi-token prediction (docs/model.md §3.8) ---------------------------------------------

struct DeepSeekModel::Mtp {
  int64_t depth = 1, n = 0;  // module k, sequence length S - k
  WeightRef enorm, hnorm, head_norm;
  Linear eh_proj;  // [H, 2H], replicated
  std::unique_ptr<DecoderLayer> layer;
  std::vector<int32_t> ids_host, targets_host;
  kernels::DeviceArray<int32_t> ids, targets;
  // dz: the head's input gradient, made by its forward (this rank's part of the sum over ranks).
  kernels::DeviceArray<float> e, en, rstd_e, hprev, hn, rstd_h, cat, m, h, z, rstd_z, dz, dh;

  Mtp(const LayerEnv& env, int64_t k, int64_t B, int64_t S, const RopeTables* rope)
      : depth(k), n(S - k) {
    const config::ModelConfig& c = *env.cfg;
    const int64_t index = c.num_hidden_layers + k - 1, H = c.hidden_size, rows = B * n;
    const std::string p = fmt::format("model.layers.{}.", index);
    enorm.bind(*env.params, p + "enorm.weight");
    hnorm.bind(*env.params, p + "hnorm.weight");
    eh_proj = Linear(*env.params, p + "eh_proj.weight");
    head_norm.bind(*env.params, p + "shared_head.norm.weight");
    layer = std::make_unique<DecoderLayer>(env, index, B, n, rope);
    kernels::Backend& be = *env.be;
    ids_host.resize(size_t(rows)), targets_host.resize(size_t(rows));
    ids.resize(be, rows), targets.resize(be, rows);
    for (auto* v : {&e, &en, &hprev, &hn, &m, &h, &z, &dz, &dh}) v->resize(be, rows * H);
    rstd_e.resize(be, rows), rstd_h.resize(be, rows), rstd_z.resize(be, rows);
    cat.resize(be, rows * 2 * H);
  }
  int64_t saved_floats() const {  // besides its decoder layer's buffers (in the activation store)
    int64_t total = 0;
    for (auto* v : {&e, &en, &rstd_e, &hprev, &hn, &rstd_h, &cat, &m, &h, &z, &rstd_z, &dz})
      total += int64_t(v->size());
    return total;
  }
};

// ---- model -----------------------------------------------------------------------------------

DeepSeekModel::DeepSeekModel(const config::ModelConfig& cfg, kernels::Backend& be, Collectives& coll,
                             ParamStore& params, int64_t B, int64_t S, bool sequence_parallel,
                             const StageSpec& stage)
    : cfg_(cfg), be_(be), coll_(coll), acts_(stage.recompute_arena), rope_(make_rope_tables(cfg, S, be)), B_(B), S_(S),
      H_(cfg.hidden_size),
      V_(cfg.vocab_size), L_(cfg.num_hidden_layers), tp_(coll.tp_size()), sp_(sequence_parallel && coll.tp_size() > 1) {
  const int64_t N = B * S;
  be_.reserve_attention(S);  // the attention kernels' scratch, once (MTP modules run shorter sequences)
  const int64_t block = plan::vocab_block(V_, tp_);
  v0_ = std::min(V_, coll.tp_rank() * block), Vl_ = std::min(V_, v0_ + block) - v0_;
  part_ = token_part(N, tp_, coll.tp_rank());
  rows_ = sp_ ? part_.count : N;
  ones_.resize(be_, N);
  be_.fill({ones_.data(), {N}}, 1.0f);
  ws_ = stage.workspace ? stage.workspace : std::make_shared<InstanceWorkspace>();
  if (!ws_->cast) ws_->cast = std::make_unique<ComputeCast>(be_, params.compute_dtype());
  DS_CHECK(ws_->cast->dtype() == params.compute_dtype(), "instances of two compute types share a workspace");
  env_ = LayerEnv{&cfg_, &be_, &coll_, &params, &ws_->scratch, &acts_, ones_.data(), &progress_, tp_, coll.tp_rank(), sp_,
                  nullptr, 0, ws_->cast.get(), &ws_->ep};
  if (sp_) {  // the layers' three shared [N, H] buffers
    grow(ws_->full, be_, 3 * N * H_);
    env_.full = &ws_->full, env_.full_len = N * H_;
  }
  mtp_env_ = env_;
  mtp_env_.sp = false;
  first_ = stage.first_layer, end_ = stage.end_layer < 0 ? L_ : stage.end_layer;
  has_embed_ = stage.embedding, has_head_ = stage.head;
  DS_CHECK(0 <= first_ && first_ <= end_ && end_ <= L_, "stage layers [{}, {}) of {}", first_, end_, L_);
  if (has_embed_) {
    embed_.bind(params, "model.embed_tokens.weight");
    const uint16_t* lp = params.compute_values("model.embed_tokens.weight");
    embed_table_ = lp ? kernels::ConstView{lp, params.compute_dtype()} : kernels::f32(embed_.w);
  } else if (has_head_ && cfg.num_nextn_predict_layers > 0) {
    DS_CHECK(stage.embed_table.data && stage.embed_g, "the last stage's MTP modules need the embedding's mirror");
    embed_table_ = stage.embed_table, embed_.g = stage.embed_g;
  }
  if (has_head_) {
    norm_.bind(params, "model.norm.weight");
    lm_head_ = Linear(params, "lm_head.weight");
    DS_CHECK(lm_head_.out() == Vl_ && lm_head_.in() == H_, "lm_head: [{}, {}] held, [{}, {}] expected", lm_head_.out(),
             lm_head_.in(), Vl_, H_);
  }
  int64_t scratch = 0;
  const int64_t recomputed = stage.recompute_layers < 0 ? end_ - first_ : stage.recompute_layers;
  for (int64_t i = first_; i < end_; ++i) {
    const Recompute mode = i - first_ < recomputed ? stage.recompute : Recompute::kNone;
    layers_.push_back(std::make_unique<DecoderLayer>(env_, i, B, S, &rope_, mode));
    scratch = std::max(scratch, layers_.back()->scratch_floats(N));
  }
  for (int64_t k = 1; has_head_ && k <= cfg.num_nextn_predict_layers; ++k) {
    DS_CHECK(S - k >= 1, "MTP depth {} needs seq_length > {}", k, k);
    mtp_.push_back(std::make_unique<Mtp>(mtp_env_, k, B, S, &rope_));
    scratch = std::max({scratch, mtp_.back()->layer->scratch_floats(N), 2 * N * H_ + 64});
  }
  ws_->scratch.reserve(be_, scratch);
  acts_.finalize(be_);
  ids_host_.resize(size_t(N)), local_ids_host_.resize(size_t(N)), targets_host_.resize(size_t(N));
  local_ids_.resize(be_, N), targets_.resize(be_, N);
  for (int64_t i = first_; i <= end_; ++i) hidden_.emplace_back(be_, rows_ * H_);
  if (has_head_) {
    // From the vocabulary block, not this rank's rows (the last rank may hold fewer): every
    // tensor-parallel rank runs as many chunks, each with its reductions.
    chunk_ = plan::loss_chunk_rows(N, H_, std::min(V_, block), stage.loss_chunk_rows);
    z_.resize(be_, rows_ * H_), rstd_f_.resize(be_, rows_), dz_.resize(be_, N * H_);
    grow(ws_->logits, be_, chunk_ * Vl_), grow(ws_->loss_rows, be_, N);
    if (sp_) z_full_.resize(be_, N * H_);
    if (tp_ > 1) grow(ws_->row_max, be_, chunk_), grow(ws_->row_sums, be_, 2 * chunk_);
  }
  if (has_embed_) dh_ = &ws_->dh_first, grow(ws_->dh_first, be_, rows_ * H_);
  else own_dh_.resize(be_, rows_ * H_);
  grow(ws_->tmp1, be_, N * H_), grow(ws_->tmp2, be_, N * H_), grow(ws_->norm_dw, be_, H_);
}

int64_t InstanceWorkspace::bytes() const {
  int64_t floats = scratch.capacity();
  for (const kernels::DeviceArray<float>* v :
       {&tmp1, &tmp2, &full, &logits, &row_max, &row_sums, &loss_rows, &norm_dw, &dh_first})
    floats += v->size();
  // (the conversions grow in the first step)
  return floats * int64_t(sizeof(float)) + (cast ? cast->bytes() : 0) + ep.bytes();
}

DeepSeekModel::~DeepSeekModel() = default;

void DeepSeekModel::mark_workspace_volatile(WeightGradDeferral& d) const {
  // The shared workspace by object: another instance may grow (move) a buffer of it.
  d.add_volatile(&ws_->scratch.buffer());
  const InstanceWorkspace& w = *ws_;
  const EpBackwardBuffers& ep = w.ep;
  for (const kernels::DeviceArray<float>* v :
       {&w.tmp1, &w.tmp2, &w.full, &w.logits, &ep.dYr, &ep.dYe, &ep.dMe, &ep.dGUe, &ep.Xs})
    d.add_volatile(v);
  acts_.mark_volatile(d);  // a recomputing layer's buffers are rewritten by the next one's backward
  d.add_volatile(&ws_->dh_first);
  for (const kernels::DeviceArray<float>* v : {&dz_, &own_dh_}) d.add_volatile(v->data(), v->size());
  // An MTP module's gradient buffer is its decoder layer's running output gradient.
  for (const auto& m : mtp_) d.add_volatile(m->dh.data(), m->dh.size());
}

std::vector<int64_t> DeepSeekModel::moe_layer_ids() const {
  std::vector<int64_t> out;
  for (int64_t i = first_; i < end_; ++i)
    if (cfg_.is_moe_layer(i)) out.push_back(i);
  for (int64_t k = 1; k <= int64_t(mtp_.size()); ++k)
    if (cfg_.is_moe_layer(L_ + k - 1)) out.push_back(L_ + k - 1);
  return out;
}

std::vector<MoeLayer*> DeepSeekModel::moe_layers() {
  std::vector<MoeLayer*> out;
  for (auto& l : layers_)
    if (l->moe()) out.push_back(l->moe());
  for (auto& m : mtp_)
    if (m->layer->moe()) out.push_back(m->layer->moe());
  return out;
}

int64_t DeepSeekModel::saved_activation_bytes() const {
  int64_t floats = z_.size() + z_full_.size() + rstd_f_.size() + int64_t(ids_host_.size()) * 3;
  for (const auto& h : hidden_) floats += h.size();
  for (const auto& m : mtp_) floats += m->saved_floats();
  return floats * int64_t(sizeof(float)) + acts_.kept_bytes() + acts_.recomputed_bytes();
}

std::vector<float> DeepSeekModel::hidden_state(int64_t i) const {
  const kernels::DeviceArray<float>& h = hidden_.at(size_t(i - first_));
  std::vector<float> out(size_t(h.size()));
  be_.copy_to_host(out.data(), h.data(), h.size() * int64_t(sizeof(float)));
  return out;
}

int64_t DeepSeekModel::own_activation_bytes() const {
  return saved_activation_bytes() - acts_.recomputed_bytes();
}

int64_t DeepSeekModel::residual_region_bytes() const {
  // The hidden states, and per layer the two normed inputs and the residual sum (rows x H each)
  // where the layer keeps them (a selective layer keeps the residual sum only).
  int64_t per_layer = 0;
  for (const auto& l : layers_)
    per_layer += l->recompute() == Recompute::kNone ? 3 : l->recompute() == Recompute::kSelective ? 1 : 0;
  return int64_t(sizeof(float)) * rows_ * H_ * (int64_t(hidden_.size()) + per_layer + (has_head_ ? 1 : 0));
}

int64_t DeepSeekModel::own_workspace_bytes() const {
  int64_t floats = dz_.size() + own_dh_.size() + ones_.size();
  for (const auto& m : mtp_) floats += m->dh.size();
  return floats * int64_t(sizeof(float));
}

// Token ids as rows of this rank's vocabulary shard: id - v0 when in [v0, v0 + Vl), else -1.
void DeepSeekModel::map_ids(int32_t* local, const int32_t* ids, int64_t n) const {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r = int64_t(ids[t]) - v0_;
    local[t] = r >= 0 && r < Vl_ ? int32_t(r) : -1;
  }
}

// out [n,H] = the embedding rows of all n tokens (the vocabulary-parallel lookup: each rank
// contributes the rows it holds, the sum over the ranks is the lookup).
void DeepSeekModel::embed(float* out, const int32_t* local_ids, int64_t n) {
  be_.embedding_forward({out, {n, H_}}, {embed_table_, {Vl_, H_}}, {local_ids, {n}});
  coll_.tp_all_reduce(out, n * H_);
}

// The LM head and the cross-entropy over `rows` tokens of z [rows,H] (all tokens), in chunks of
// chunk_ rows (docs/design.md §6.13): a chunk's logits [c, Vl] — this rank's vocabulary columns
// — live in the workspace's logits only while the chunk is worked on. Vocabulary-parallel, the row maximum and
// the sums of exponentials are reduced over the ranks per chunk, never the logits. The fused
// cross-entropy leaves the chunk's logit gradient in place, and when a backward follows it is
// used at once: the chunk's rows of dz and its term of dW_lm. The head's weight gradient is
// thus made during forward, never deferred (a zero-bubble W has nothing of the head to run),
// and the micro-batches still add theirs in micro-batch order.
double DeepSeekModel::head_loss(const float* z, const int32_t* targets, int64_t rows, double weight,
                                double loss_scale, float* dz, bool keep) {
  const float grad_scale = float(weight * loss_scale);
  const WeightGradDeferral::Scope now(nullptr);
  float* logits = ws_->logits.data();
  if (keep) kept_logits_.resize(size_t(rows * Vl_));
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_) {
    const int64_t c = std::min(chunk_, rows - r0);
    const float* zc = z + r0 * H_;
    lm_head_.forward(env_, logits, zc, c);
    if (keep) be_.copy_to_host(kept_logits_.data() + r0 * Vl_, logits, c * Vl_ * int64_t(sizeof(float)));
    if (tp_ == 1) {
      be_.cross_entropy({ws_->loss_rows.data() + r0, {c}}, {logits, {c, V_}}, {targets + r0, {c}}, grad_scale);
    } else {
      be_.cross_entropy_row_max({ws_->row_max.data(), {c}}, {logits, {c, Vl_}});
      coll_.tp_all_reduce_max(ws_->row_max.data(), c);
      be_.cross_entropy_row_sums({ws_->row_sums.data(), {c, 2}}, {logits, {c, Vl_}}, {ws_->row_max.data(), {c}},
                                 {targets + r0, {c}}, v0_);
      coll_.tp_all_reduce(ws_->row_sums.data(), 2 * c);
      be_.cross_entropy_finish({ws_->loss_rows.data() + r0, {c}}, {logits, {c, Vl_}}, {ws_->row_max.data(), {c}},
                               {ws_->row_sums.data(), {c, 2}}, {targets + r0, {c}}, v0_, grad_scale);
    }
    if (dz) lm_head_.backward(env_, dz + r0 * H_, logits, zc, c);
    progress_.poll();
  }
  loss_host_.resize(size_t(rows));  // the loss is read on the host through the backend
  be_.copy_to_host(loss_host_.data(), ws_->loss_rows.data(), rows * int64_t(sizeof(float)));
  double sum = 0;
  for (int64_t r = 0; r < rows; ++r) sum += loss_host_[size_t(r)];
  return sum * weight;
}

Losses DeepSeekModel::forward_stage(const int32_t* tokens, const float* h_in, const LossScale& scale) {
  const int64_t N = B_ * S_;
  for (int64_t b = 0; b < B_; ++b)
    for (int64_t t = 0; t < S_; ++t) {
      ids_host_[size_t(b * S_ + t)] = tokens[b * (S_ + 1) + t];
      targets_host_[size_t(b * S_ + t)] = tokens[b * (S_ + 1) + t + 1];
    }
  map_ids(local_ids_host_.data(), ids_host_.data(), N);
  be_.copy_from_host(local_ids_.data(), local_ids_host_.data(), N * int64_t(sizeof(int32_t)));
  be_.copy_from_host(targets_.data(), targets_host_.data(), N * int64_t(sizeof(int32_t)));
  for (auto* moe : moe_layers()) moe->clear_aux();
  const trace::Scope whole("model", "forward");
  if (!has_embed_) {
    DS_CHECK(h_in, "a pipeline stage after the first needs the previous stage's output");
    be_.copy_strided({hidden_[0].data(), {rows_, H_}}, {h_in, {rows_, H_}});
  } else if (sp_) {  // the lookup's sum over the ranks, scattered by token parts
    be_.embedding_forward({ws_->tmp1.data(), {N, H_}}, {embed_table_, {Vl_, H_}}, {local_ids_.data(), {N}});
    coll_.tp_reduce_scatter_rows(hidden_[0].data(), ws_->tmp1.data(), rows_, H_);
  } else {
    const trace::Scope t("model", "forward embedding");
    embed(hidden_[0].data(), local_ids_.data(), N);
  }
  for (size_t j = 0; j < layers_.size(); ++j) {
    const trace::Scope t("model", "forward layer", first_ + int64_t(j));
    layers_[j]->forward(hidden_[j + 1].data(), hidden_[j].data(), B_, S_, scale);
  }
  Losses out;
  if (has_head_) {
    const trace::Scope t("model", "forward head");
    be_.rmsnorm_forward({z_.data(), {rows_, H_}}, {rstd_f_.data(), {rows_}}, {hidden_.back().data(), {rows_, H_}},
                        {norm_.w, {H_}}, float(cfg_.rms_norm_eps));
    const float* z = z_.data();
    if (sp_) coll_.tp_all_gather_rows(z_full_.data(), z_.data(), rows_, H_), z = z_full_.data();
    out.ce = head_loss(z, targets_.data(), N, 1.0 / scale.tokens, scale.gradient, scale.backward ? dz_.data() : nullptr,
                       keep_logits_);
    if (!mtp_.empty()) mtp_forward(tokens, scale, out);
  }
  for (auto* moe : moe_layers()) {
    moe->stats().aux_loss = moe->fetch_aux();
    out.aux += moe->stats().aux_loss;
  }
  return out;
}

void DeepSeekModel::mtp_forward(const int32_t* tokens, const LossScale& scale, Losses& out) {
  const double lambda = cfg_.mtp_loss_weight / double(mtp_.size());
  const float* z = sp_ ? z_full_.data() : z_.data();  // h^0: the main model's final normed states, all tokens
  for (size_t k = 0; k < mtp_.size(); ++k) {
    Mtp& m = *mtp_[k];
    const int64_t n = m.n, rows = B_ * n, depth = m.depth;
    const float* prev = k == 0 ? z : mtp_[k - 1]->h.data();
    const int64_t prev_len = n + 1;  // S for the first module, S - (k - 1) after
    for (int64_t b = 0; b < B_; ++b) {
      be_.copy_strided({m.hprev.data() + b * n * H_, {n, H_}}, {prev + b * prev_len * H_, {n, H_}});
      for (int64_t i = 0; i < n; ++i) {
        m.ids_host[size_t(b * n + i)] = tokens[b * (S_ + 1) + i + depth];
        m.targets_host[size_t(b * n + i)] = tokens[b * (S_ + 1) + i + depth + 1];
      }
    }
    map_ids(m.ids_host.data(), m.ids_host.data(), rows);  // only this rank's vocabulary rows are looked up
    be_.copy_from_host(m.ids.data(), m.ids_host.data(), rows * int64_t(sizeof(int32_t)));
    be_.copy_from_host(m.targets.data(), m.targets_host.data(), rows * int64_t(sizeof(int32_t)));
    const float eps = float(cfg_.rms_norm_eps);
    embed(m.e.data(), m.ids.data(), rows);
    be_.rmsnorm_forward({m.en.data(), {rows, H_}}, {m.rstd_e.data(), {rows}}, {m.e.data(), {rows, H_}},
                        {m.enorm.w, {H_}}, eps);
    be_.rmsnorm_forward({m.hn.data(), {rows, H_}}, {m.rstd_h.data(), {rows}}, {m.hprev.data(), {rows, H_}},
                        {m.hnorm.w, {H_}}, eps);
    be_.copy_strided({m.cat.data(), {rows, H_}, {2 * H_, 1}},
                     {m.en.data(), {rows, H_}});  // [enorm(e) ; hnorm(h)]
    be_.copy_strided({m.cat.data() + H_, {rows, H_}, {2 * H_, 1}}, {m.hn.data(), {rows, H_}});
    m.eh_proj.forward(env_, m.m.data(), m.cat.data(), rows);
    m.layer->forward(m.h.data(), m.m.data(), B_, n, scale);
    be_.rmsnorm_forward({m.z.data(), {rows, H_}}, {m.rstd_z.data(), {rows}}, {m.h.data(), {rows, H_}},
                        {m.head_norm.w, {H_}}, eps);
    const double grad_scale = lambda / (scale.sequences * double(n));
    out.mtp += head_loss(m.z.data(), m.targets.data(), rows, grad_scale, scale.gradient,
                         scale.backward ? m.dz.data() : nullptr, false);
  }
}

void DeepSeekModel::backward_stage(const float* dh_out) {
  const int64_t N = B_ * S_;
  const trace::Scope whole("model", "backward");
  if (has_head_) {
    const trace::Scope t("model", "backward head");
    // Head: forward left dz = dlogits W_lm, this rank's vocabulary columns' part, to be summed
    // over the ranks (and added dW_lm += dlogits^T z). MTP adds its gradient of h^0 = z.
    coll_.tp_all_reduce(dz_.data(), N * H_);
    progress_.poll();
    if (!mtp_.empty()) mtp_backward(dz_.data());
    const float* dz = dz_.data() + (sp_ ? part_.first * H_ : 0);  // this rank's rows of the complete gradient
    if (sp_) {  // the final norm's weight gradient from this rank's tokens, summed over the ranks
      be_.fill({ws_->norm_dw.data(), {H_}}, 0.0f);
      be_.rmsnorm_backward({dh_->data(), {rows_, H_}}, {ws_->norm_dw.data(), {H_}}, {dz, {rows_, H_}},
                           {hidden_.back().data(), {rows_, H_}}, {norm_.w, {H_}}, {rstd_f_.data(), {rows_}});
      coll_.tp_all_reduce(ws_->norm_dw.data(), H_);
      be_.add({norm_.g, {H_}}, {ws_->norm_dw.data(), {H_}});
    } else {
      be_.rmsnorm_backward({dh_->data(), {rows_, H_}}, {norm_.g, {H_}}, {dz, {rows_, H_}},
                           {hidden_.back().data(), {rows_, H_}}, {norm_.w, {H_}}, {rstd_f_.data(), {rows_}});
    }
    // The head and the MTP modules (which share lm_head) are final together.
    const int64_t D = int64_t(mtp_.size());
    for (int64_t l = L_ + D; l >= L_; --l) progress_.grads_final(l);
  } else {
    DS_CHECK(dh_out, "a pipeline stage before the last needs the next stage's input gradient");
    be_.copy_strided({dh_->data(), {rows_, H_}}, {dh_out, {rows_, H_}});
  }
  for (int64_t j = int64_t(layers_.size()) - 1; j >= 0; --j) {
    const trace::Scope t("model", "backward layer", first_ + j);
    layers_[size_t(j)]->backward(dh_->data(), hidden_[size_t(j)].data(), B_, S_, ws_->tmp1.data(), ws_->tmp2.data());
    progress_.grads_final(first_ + j);
  }
  if (!has_embed_) return;
  const trace::Scope t("model", "backward embedding");
  const float* dh0 = dh_->data();
  if (sp_) coll_.tp_all_gather_rows(ws_->tmp1.data(), dh_->data(), rows_, H_), dh0 = ws_->tmp1.data();
  be_.embedding_backward({embed_.g, {Vl_, H_}}, {dh0, {N, H_}}, {local_ids_.data(), {N}});
  progress_.grads_final(-1);
}

std::vector<int64_t> DeepSeekModel::backward_order(const config::ModelConfig& cfg) {
  const int64_t L = cfg.num_hidden_layers, D = cfg.num_nextn_predict_layers;
  std::vector<int64_t> order;
  for (int64_t l = L + D; l >= -1; --l) order.push_back(l);  // head, MTP L+D-1 ... L, L-1 ... 0, -1
  return order;
}

void DeepSeekModel::mtp_backward(float* dz) {
  for (auto& m : mtp_) be_.fill({m->dh.data(), {m->dh.size()}}, 0.0f);
  for (int64_t k = int64_t(mtp_.size()) - 1; k >= 0; --k) {
    Mtp& m = *mtp_[k];
    const int64_t n = m.n, rows = B_ * n;
    // Its own head (the gradient of its normed states its forward made, summed over the ranks),
    // then the gradient module k+1 left in m.dh.
    coll_.tp_all_reduce(m.dz.data(), rows * H_);
    be_.rmsnorm_backward({ws_->tmp2.data(), {rows, H_}}, {m.head_norm.g, {H_}}, {m.dz.data(), {rows, H_}},
                         {m.h.data(), {rows, H_}}, {m.head_norm.w, {H_}}, {m.rstd_z.data(), {rows}});
    be_.add({m.dh.data(), {rows * H_}}, {ws_->tmp2.data(), {rows * H_}});
    m.layer->backward(m.dh.data(), m.m.data(), B_, n, ws_->tmp1.data(), ws_->tmp2.data());  // m.dh = dL/dm
    ws_->scratch.reset();
    float* dcat = ws_->scratch.take(rows * 2 * H_);
    m.eh_proj.backward(env_, dcat, m.dh.data(), m.cat.data(), rows);
    // Embedding half: enorm backward, then into this rank's rows of the shared embedding table.
    be_.copy_strided({ws_->tmp1.data(), {rows, H_}}, {dcat, {rows, H_}, {2 * H_, 1}});
    be_.rmsnorm_backward({ws_->tmp2.data(), {rows, H_}}, {m.enorm.g, {H_}}, {ws_->tmp1.data(), {rows, H_}},
                         {m.e.data(), {rows, H_}}, {m.enorm.w, {H_}}, {m.rstd_e.data(), {rows}});
    be_.embedding_backward({embed_.g, {Vl_, H_}}, {ws_->tmp2.data(), {rows, H_}}, {m.ids.data(), {rows}});
    // Hidden half: hnorm backward, then into the first n positions of the previous hidden state.
    be_.copy_strided({ws_->tmp1.data(), {rows, H_}}, {dcat + H_, {rows, H_}, {2 * H_, 1}});
    be_.rmsnorm_backward({ws_->tmp2.data(), {rows, H_}}, {m.hnorm.g, {H_}}, {ws_->tmp1.data(), {rows, H_}},
                         {m.hprev.data(), {rows, H_}}, {m.hnorm.w, {H_}}, {m.rstd_h.data(), {rows}});
    float* dprev = k == 0 ? dz : mtp_[k - 1]->dh.data();
    const int64_t prev_len = n + 1;
    for (int64_t b = 0; b < B_; ++b)
      be_.add_strided({dprev + b * prev_len * H_, {n, H_}}, {ws_->tmp2.data() + b * n * H_, {n, H_}});
  }
}

}  // namespace dstrain::model
