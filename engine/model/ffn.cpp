#include "engine/model/ffn.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "engine/common/fault_inject.h"
#include "engine/plan/memory.h"

namespace dstrain::model {

SwiGluMlp::SwiGluMlp(const LayerEnv& env, const std::string& prefix, int64_t width,
                     int64_t max_tokens)
    : env_(env), H_(env.cfg->hidden_size), w_(width) {
  ParamStore& p = *env.params;
  gate_up_ = Linear(p, prefix + "gate_proj.weight", {prefix + "up_proj.weight"});
  down_ = Linear(p, prefix + "down_proj.weight");
  // Column-parallel gate/up (this rank's part of the width), row-parallel down (a partial sum).
  DS_CHECK(gate_up_.split() == plan::Shard::kColumn && down_.split() == plan::Shard::kRow &&
               gate_up_.out() == 2 * w_ && down_.in() == w_,
           "{}: the parameter table splits the MLP differently from its tensor parallelism", prefix);
  GU_ = env.acts->take(max_tokens * 2 * w_);
  M_ = env.acts->take(max_tokens * w_, true, gemm_input_dtype(env));  // read by down_proj's GEMMs only
}

// M = swiglu(GU) on N rows into the saved M, in its type (a 16-bit M written rounded, as a
// conversion of the fp32 values would round it, without an fp32 pass).
void SwiGluMlp::activate(int64_t N) { env_.be->swiglu_forward({M_.view(), {N, w_}}, {GU_.data(), {N, 2 * w_}}); }

void SwiGluMlp::recompute_selective(int64_t N) { activate(N); }

void SwiGluMlp::forward(float* out, const float* u, int64_t N) {
  gate_up_.forward(env_, GU_.data(), u, N);
  activate(N);
  // row-parallel: this rank's part of the sum
  down_.forward(env_, out, GemmInput::saved(M_), N);
}

void SwiGluMlp::backward(float* du, const float* dout, const float* u, int64_t N, float beta) {
  kernels::Backend& be = *env_.be;
  Scratch& scratch = *env_.scratch;
  float* dM = scratch.take(N * w_);
  float* dGU = scratch.take(N * 2 * w_);
  down_.backward(env_, dM, dout, GemmInput::saved(M_), N);
  env_.poll();
  be.swiglu_backward({dGU, {N, 2 * w_}}, {dM, {N, w_}}, {GU_.data(), {N, 2 * w_}});
  // Column-parallel gate/up: the input gradient is this rank's part (the caller sums over TP).
  gate_up_.backward(env_, du, dGU, u, N, beta);
}

MoeLayer::MoeLayer(const LayerEnv& env, const std::string& prefix, int64_t B, int64_t S) : env_(env), prefix_(prefix) {
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
  gate_ = Linear(p, mlp + "gate.weight");  // router logits in fp32 (HF): ParamStore::reads_fp32
  if (p.has(mlp + "gate.e_score_correction_bias")) bias_ = p.param(mlp + "gate.e_score_correction_bias");
  gate_up_.resize(E_);
  down_.resize(E_);
  for (int64_t e = 0; e < E_; ++e) {
    const std::string ex = fmt::format("{}experts.{}.", mlp, e);
    if (!p.has(ex + "gate_proj.weight")) continue;  // another expert-parallel rank's expert
    gate_up_[e] = Linear(p, ex + "gate_proj.weight", {ex + "up_proj.weight"});
    down_[e] = Linear(p, ex + "down_proj.weight");
  }
  int64_t N = B * S;
  if (m.num_shared() > 0)
    shared_ = std::make_unique<SwiGluMlp>(env, mlp + "shared_experts.",
                                          m.num_shared() * I_ / env.tp_size, N);
  N = token_part(B * S, env.tp_size, 0).count;  // the most tokens this rank routes
  ep_ = env.coll->ep_size();
  ActivationStore& st = *env.acts;
  scores_ = st.take(N * E_), w_ = st.take(N * k_), dscores_ = st.take(N * E_);
  // Under expert parallelism the dispatched rows are only sent: never read by backward.
  const kernels::DType lp = gemm_input_dtype(env);
  // The experts' activations of the dispatched rows (GUp, Mp) exist only where the experts run
  // here: under expert parallelism their owners hold them (GUe, Me).
  // Under expert parallelism the dispatched rows are only sent: EpBackwardBuffers::Xs.
  Xp_ = st.take(ep_ == 1 ? N * k_ * H_ : 0, true, lp);
  GUp_ = st.take(ep_ == 1 ? N * k_ * 2 * I_ : 0);
  Mp_ = st.take(ep_ == 1 ? N * k_ * I_ : 0, true, lp);
  Yp_ = st.take(N * k_ * H_);
  idx_dev_.resize(*env.be, N * k_), pos_dev_.resize(*env.be, N * k_), src_dev_.resize(*env.be, N * k_);
  counts_dev_.resize(*env.be, E_), counts32_.assign(size_t(E_), 0);
  balance_stats_.resize(*env.be, 2 * B * E_), aux_dev_.resize(*env.be, 1);
  env.be->fill({aux_dev_.data(), {1}}, 0.0f);
  counts_.assign(E_, 0), offsets_.assign(E_ + 1, 0);
  stats_.loads.assign(E_, 0);
  DS_CHECK(E_ % ep_ == 0, "{} experts over {} expert-parallel ranks", E_, ep_);
  El_ = E_ / ep_, e0_ = env.coll->ep_rank() * El_;
  if (ep_ > 1) {  // sized for balanced routing (as many rows received as sent) and a margin; grown when a step needs more
    Xr_ = st.take_dynamic(), Xe_ = st.take_dynamic(true), GUe_ = st.take_dynamic(), Me_ = st.take_dynamic(true);
    Ye_ = &env.ep_bwd->dYe, Yr_ = &env.ep_bwd->dYr;  // forward-only: in the backward buffers' space
    kernels::Backend& be = *env.be;
    const int64_t recv = plan::expert_receive_rows(N * k_);  // (the rows sent, Xs, are N k exactly)
    stats_.recv_rows_balanced = N * k_;
    DS_CHECK(env.ep_bwd, "an expert-parallel MoE layer without its instance's backward buffers");
    EpBackwardBuffers& b = *env.ep_bwd;  // shared by the instance's MoE layers: reserve never shrinks
    for (kernels::DeviceArray<float>* v : {Xr_, Xe_, &b.dYr, &b.dYe}) v->reserve(be, recv * H_);
    b.Xs.reserve(be, N * k_ * H_);
    GUe_->reserve(be, recv * 2 * I_), b.dGUe.reserve(be, recv * 2 * I_);
    Me_->reserve(be, recv * I_), b.dMe.reserve(be, recv * I_);
  }
  bad_counts_at_ = fault_at(Fault::kEpBadCounts);
}

// The routed rows and the experts' activations straight into their saved type (16-bit: rounded
// by the producing op, as a conversion of the fp32 values would round them).
void MoeLayer::dispatch_rows(const float* u_part, int64_t rows) {
  if (ep_ == 1)
    return env_.be->gather_rows({Xp_.view(), {rows, H_}}, {u_part, {rows / k_, H_}}, {src_dev_.data(), {rows}});
  kernels::DeviceArray<float>& xs = env_.ep_bwd->Xs;  // only sent
  xs.resize(*env_.be, rows * H_);
  env_.be->gather_rows({xs.data(), {rows, H_}}, {u_part, {rows / k_, H_}}, {src_dev_.data(), {rows}});
}

void MoeLayer::swiglu_into(kernels::View M, const float* GU, int64_t rows) {
  env_.be->swiglu_forward({M, {rows, I_}}, {GU, {rows, 2 * I_}});
}

void MoeLayer::recompute_selective(const float* u_part, int64_t N) {
  kernels::Backend& be = *env_.be;
  env_.scratch->reset();
  if (shared_) shared_->recompute_selective(N);
  if (ep_ == 1) {
    const int64_t rows = token_part(N, env_.tp_size, env_.tp_rank).count * k_;
    dispatch_rows(u_part, rows);
    swiglu_into(Mp_.view(), GUp_.data(), rows);
  } else {  // the shared vectors hold another layer's rows: sized for this one's again
    Xe_->resize(be, recv_total_ * H_), Me_->resize(be, recv_total_ * I_);
    be.gather_rows({Xe_->data(), {recv_total_, H_}}, {Xr_->data(), {recv_total_, H_}},
                   {to_source_dev_.data(), {recv_total_}});
    be.swiglu_forward({Me_->data(), {recv_total_, I_}}, {GUe_->data(), {recv_total_, 2 * I_}});
  }
}

int64_t MoeLayer::scratch_floats(int64_t N) const {
  const int64_t rows = N * k_;
  // (dM and dGU of the dispatched rows only where the experts run here; under expert
  // parallelism they are the instance's EpBackwardBuffers)
  return rows * (2 * H_ + (ep_ == 1 ? 3 * I_ : 0)) + N * (k_ + 2 * E_) + E_ * H_ +
         (shared_ ? shared_->scratch_floats(N) : 0) + 192;
}

// Router, then the dispatch plan: rows sorted by (expert, token, slot), pos[t,j] = row of slot j,
// made on the device; the host reads the rows per expert (the grouped GEMMs' sizes).
void MoeLayer::route(const float* u, int64_t N) {
  kernels::Backend& be = *env_.be;
  float* logits = env_.scratch->take(N * E_);
  gate_.forward(env_, logits, u, N);
  be.router_forward({idx_dev_.data(), {N, rp_.top_k}}, {w_.data(), {N, rp_.top_k}},
                    {scores_.data(), {N, rp_.num_experts}}, {logits, {N, rp_.num_experts}}, {bias_, {rp_.num_experts}},
                    rp_);
  be.moe_plan({pos_dev_.data(), {N, k_}}, {src_dev_.data(), {N * k_}}, {counts_dev_.data(), {E_}},
              {idx_dev_.data(), {N, k_}});
  be.copy_to_host(counts32_.data(), counts_dev_.data(), E_ * int64_t(sizeof(int32_t)));
  routed_ = N;
  for (int64_t e = 0; e < E_; ++e) {
    counts_[e] = counts32_[size_t(e)];
    offsets_[e + 1] = offsets_[e] + counts_[e];
  }
  if (!recomputing_)
    for (int64_t e = 0; e < E_; ++e) stats_.loads[e] += counts_[e];
}

std::vector<int32_t> MoeLayer::selection() const {
  std::vector<int32_t> idx(size_t(routed_ * k_));
  env_.be->copy_to_host(idx.data(), idx_dev_.data(), routed_ * k_ * int64_t(sizeof(int32_t)));
  return idx;
}

void MoeLayer::clear_aux() { env_.be->fill({aux_dev_.data(), {1}}, 0.0f); }

double MoeLayer::fetch_aux() {
  float v = 0;
  env_.be->copy_to_host(&v, aux_dev_.data(), int64_t(sizeof(float)));
  return v;
}

// Sequence-wise (or batch-wise) balance loss, docs/model.md §5.2, on the device. Its gradient
// with respect to the scores does not depend on anything downstream, so it is computed here and
// kept for backward. Under tensor parallelism each rank holds the routing of its token part
// only: the statistics of every sequence (expert counts f and mean normalised scores P) are
// summed over the ranks first, so every rank computes the whole loss and the gradient of its own
// tokens.
void MoeLayer::balance_loss(TokenPart part, int64_t B, int64_t S, const LossScale& scale) {
  const double alpha = env_.cfg->aux_loss_alpha;
  const int64_t n = part.count;
  if (alpha <= 0.0) {
    env_.be->fill({dscores_.data(), {n * E_}}, 0.0f);
    return;
  }
  const bool per_seq = env_.cfg->seq_aux;
  const int64_t groups = per_seq ? B : 1;
  // Each group's weight in the global mean: 1/B_global per sequence, or this micro-batch's share.
  const double group_weight = per_seq ? 1.0 / scale.sequences : double(B) / scale.sequences;
  kernels::Backend::BalanceShape shape;
  shape.n = n, shape.k = k_, shape.E = E_, shape.first = part.first, shape.group_len = per_seq ? S : 0;
  shape.groups = groups, shape.T = per_seq ? S : B * S;
  DS_CHECK(2 * groups * E_ <= balance_stats_.size(), "balance statistics for {} groups", groups);
  float* stats = balance_stats_.data();
  env_.be->moe_balance_stats({stats, {2, shape.groups, shape.E}}, {idx_dev_.data(), {shape.n, shape.k}},
                             {scores_.data(), {shape.n, shape.E}}, shape);
  if (env_.tp_size > 1) env_.coll->tp_all_reduce(stats, 2 * groups * E_);  // every rank's tokens of each group
  env_.be->moe_balance_grad({dscores_.data(), {shape.n, shape.E}}, {recomputing_ ? nullptr : aux_dev_.data(), {1}},
                            {stats, {2, shape.groups, shape.E}}, {scores_.data(), {shape.n, shape.E}}, shape,
                            alpha * group_weight, scale.gradient);
}

void MoeLayer::forward(float* out_full, const float* u_full, const float* u_part, TokenPart part, int64_t B,
                       int64_t S, const LossScale& scale) {
  kernels::Backend& be = *env_.be;
  const int64_t N = B * S, n = part.count, rows = n * k_;
  env_.scratch->reset();
  route(u_part, n);
  balance_loss(part, B, S, scale);
  dispatch_rows(u_part, rows);
  if (ep_ == 1) {
    experts_forward({Xp_.raw(), Xp_.dtype()}, GUp_.data(), Mp_.view(), Yp_.data(), counts_.data(), offsets_.data(), 0,
                    E_, rows);
    if (shared_) shared_->forward(out_full, u_full, N);
    else
      be.fill({out_full, {N * H_}}, 0.0f);
    be.moe_combine({out_full + part.first * H_, {n, H_}}, {Yp_.data(), {n * k_, H_}}, {w_.data(), {n, k_}},
                   {pos_dev_.data(), {n, k_}});
    return;
  }
  // Expert parallelism: the rows go to the ranks that own their experts (the rows sorted by
  // expert are already grouped by owner), run there grouped by local expert, and come back.
  plan_exchange(rows);
  const int64_t recv = recv_total_;
  if (recv * H_ > Xr_->capacity()) {
    // More rows than the receive side holds (it starts at balanced routing and an eighth more,
    // which the plan counts): it grows once, with a quarter more room, and keeps that (no
    // allocation in later steps unless the imbalance grows further) — said aloud, since the plan
    // did not count it.
    const int64_t room = recv + recv / 4;
    spdlog::info("{}mlp (expert-parallel rank {}): its experts received {} rows, {:.2f}x the balanced {}; its "
                 "receive buffers grow to {} rows",
                 prefix_, env_.coll->ep_rank(), recv, double(recv) / double(stats_.recv_rows_balanced),
                 stats_.recv_rows_balanced, room);
    EpBackwardBuffers& b = *env_.ep_bwd;
    for (kernels::DeviceArray<float>* v : {Xr_, Xe_, &b.dYr, &b.dYe}) v->reserve(be, room * H_);
    GUe_->reserve(be, room * 2 * I_), b.dGUe.reserve(be, room * 2 * I_);
    Me_->reserve(be, room * I_), b.dMe.reserve(be, room * I_);
  }
  for (kernels::DeviceArray<float>* v : {Xr_, Xe_, Yr_, Ye_}) v->resize(be, recv * H_);
  GUe_->resize(be, recv * 2 * I_), Me_->resize(be, recv * I_);
  auto dispatch =
      env_.coll->ep_all_to_all_v(Xr_->data(), scaled(recv_rows_, H_), env_.ep_bwd->Xs.data(), scaled(send_rows_, H_));
  if (shared_) shared_->forward(out_full, u_full, N);  // while the rows travel
  else
    be.fill({out_full, {N * H_}}, 0.0f);
  if (dispatch) dispatch->wait();
  be.gather_rows({Xe_->data(), {recv, H_}}, {Xr_->data(), {recv, H_}}, {to_source_dev_.data(), {recv}});
  experts_forward(kernels::f32(Xe_->data()), GUe_->data(), {Me_->data(), kernels::DType::kF32}, Ye_->data(),
                  ecounts_.data(), eoffsets_.data(), e0_, El_, recv);
  be.gather_rows({Yr_->data(), {recv, H_}}, {Ye_->data(), {recv, H_}}, {to_expert_dev_.data(), {recv}});
  auto combine = env_.coll->ep_all_to_all_v(Yp_.data(), scaled(send_rows_, H_), Yr_->data(), scaled(recv_rows_, H_));
  if (combine) combine->wait();
  be.moe_combine({out_full + part.first * H_, {n, H_}}, {Yp_.data(), {n * k_, H_}}, {w_.data(), {n, k_}},
                 {pos_dev_.data(), {n, k_}});
}

std::vector<int64_t> MoeLayer::scaled(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * width;
  return out;
}

// The exchange of this forward (and its backward): every rank's tokens per expert, summed over
// the expert-parallel group (one int64 all-reduce of [ranks x experts] counts plus each rank's
// row total, which every rank checks against the counts); the rows this rank sends to each rank
// and receives from it; and the order of the received rows — by source rank, each source's
// sorted by expert — against the order grouped by local expert that the GEMMs run in.
void MoeLayer::plan_exchange(int64_t rows) {
  const int P = ep_, me = env_.coll->ep_rank();
  std::vector<int64_t> table(size_t(P * (E_ + 1)), 0);  // [P, E] counts, then [P] row totals
  std::copy(counts_.begin(), counts_.end(), table.begin() + me * E_);
  table[size_t(P * E_ + me)] = rows;
  if (bad_counts_at_ > 0 && !recomputing_ && ++forwards_ == bad_counts_at_ && me == P - 1) ++table[size_t(me * E_)];  // injected fault
  env_.coll->ep_all_reduce(table.data(), int64_t(table.size()));
  for (int q = 0; q < P; ++q) {
    int64_t sum = 0;
    for (int64_t e = 0; e < E_; ++e) sum += table[size_t(q * E_ + e)];
    if (sum != table[size_t(P * E_ + q)])
      throw Error(fmt::format("expert-parallel group ep: rank {} of {} announced {} token rows for its experts' owners "
                              "but routes {}: the ranks disagree on the counts of the dispatch, so no rank sends",
                              q, P, sum, table[size_t(P * E_ + q)]));
  }
  send_rows_.assign(size_t(P), 0), recv_rows_.assign(size_t(P), 0);
  for (int q = 0; q < P; ++q)
    for (int64_t e = q * El_; e < (q + 1) * El_; ++e) send_rows_[size_t(q)] += counts_[size_t(e)];
  ecounts_.assign(size_t(El_), 0);
  for (int q = 0; q < P; ++q)
    for (int64_t le = 0; le < El_; ++le) {
      const int64_t c = table[size_t(q * E_ + e0_ + le)];
      recv_rows_[size_t(q)] += c;
      ecounts_[size_t(le)] += c;
    }
  eoffsets_.assign(size_t(El_ + 1), 0);
  for (int64_t le = 0; le < El_; ++le) eoffsets_[size_t(le + 1)] = eoffsets_[size_t(le)] + ecounts_[size_t(le)];
  recv_total_ = eoffsets_.back();
  stats_.recv_rows_max = std::max(stats_.recv_rows_max, recv_total_);
  to_source_.resize(size_t(recv_total_)), to_expert_.resize(size_t(recv_total_));
  std::vector<int64_t> cursor(eoffsets_.begin(), eoffsets_.end() - 1);
  int64_t at = 0;  // row in the received (source-major) order
  for (int q = 0; q < P; ++q)
    for (int64_t le = 0; le < El_; ++le)
      for (int64_t i = 0; i < table[size_t(q * E_ + e0_ + le)]; ++i, ++at) {
        const int64_t row = cursor[size_t(le)]++;
        to_source_[size_t(row)] = int32_t(at);
        to_expert_[size_t(at)] = int32_t(row);
      }
  kernels::Backend& be = *env_.be;
  to_source_dev_.resize(be, recv_total_), to_expert_dev_.resize(be, recv_total_);
  be.copy_from_host(to_source_dev_.data(), to_source_.data(), recv_total_ * int64_t(sizeof(int32_t)));
  be.copy_from_host(to_expert_dev_.data(), to_expert_.data(), recv_total_ * int64_t(sizeof(int32_t)));
}

namespace {

// The experts' GEMMs of one kind, launched as one grouped call. A holds rows of one activation
// buffer `a`; B rows of another activation buffer `b`, or — when b is null — a weight (`Bw`,
// `Blp`: its fp32 values in fp32, its compute copy under mixed precision). An fp32 activation buffer is converted to the
// compute type at launch; one already in it (a saved 16-bit activation) is read as it is.
struct Group {
  std::vector<float*> C;
  std::vector<int64_t> A, B;  // element offsets into a and b (or the weights' pointers, below)
  std::vector<const float*> Bw;
  std::vector<const uint16_t*> Blp;
  std::vector<int64_t> M, N, K;
  void add(float* c, int64_t a, int64_t b, int64_t m, int64_t n, int64_t k) {
    C.push_back(c), A.push_back(a), B.push_back(b), M.push_back(m), N.push_back(n), K.push_back(k);
  }
  // C [m, out] = A W^T: the layer's forward on m rows of `a` from element a_off.
  void add_forward(float* c, int64_t a_off, const Linear& w, int64_t m) { add_weight(c, a_off, w, m, w.out(), w.in()); }
  // C [m, in] = A W: its input gradient from m rows of output gradient.
  void add_input_grad(float* c, int64_t a_off, const Linear& w, int64_t m) {
    add_weight(c, a_off, w, m, w.in(), w.out());
  }
  // dW [out, in] += dY^T X: its weight gradient from m rows of dY (from dy_off) and of X (x_off).
  void add_weight_grad(const Linear& w, int64_t dy_off, int64_t x_off, int64_t m) {
    add(w.weight().g, dy_off, x_off, w.out(), w.in(), m);
  }
  void add_weight(float* c, int64_t a_off, const Linear& w, int64_t m, int64_t n, int64_t k) {
    add(c, a_off, 0, m, n, k);
    Bw.push_back(w.weight().w), Blp.push_back(w.weight().lp);
  }
  // C = op(A) op(B) (+ beta C) with A from `a` [a_len elements] and B from `b` [b_len] or,
  // when b.data is null, the weights.
  void run(const LayerEnv& env, kernels::ConstView a, int64_t a_len, kernels::ConstView b, int64_t b_len, bool ta,
           bool tb, float beta) const {
    if (C.empty()) return;
    const bool lp = env.cast && env.cast->active() && (b.data || Blp[0]);
    const kernels::DType t = lp ? env.cast->dtype() : kernels::DType::kF32;
    const int64_t es = kernels::dtype_size(t);
    const auto typed = [&](kernels::ConstView v, int slot, int64_t len) {
      if (!lp) {
        DS_CHECK(v.dtype == kernels::DType::kF32, "a 16-bit input to an fp32 expert GEMM");
        return static_cast<const char*>(v.data);
      }
      if (v.dtype == kernels::DType::kF32)  // rounded to the compute type
        return static_cast<const char*>((*env.cast)(slot, static_cast<const float*>(v.data), len).data);
      return static_cast<const char*>(v.data);
    };
    const char* ab = typed(a, 0, a_len);
    const char* bb = b.data ? typed(b, 1, b_len) : nullptr;
    std::vector<kernels::Backend::GemmProblem> problems(C.size());
    for (size_t i = 0; i < C.size(); ++i) {
      const void* pb = bb ? static_cast<const void*>(bb + B[i] * es) : lp ? static_cast<const void*>(Blp[i]) : Bw[i];
      problems[i] = {{C[i], {M[i], N[i]}},
                     {ab + A[i] * es, t, ta ? kernels::Dims{K[i], M[i]} : kernels::Dims{M[i], K[i]}},
                     {pb, t, tb ? kernels::Dims{N[i], K[i]} : kernels::Dims{K[i], N[i]}}};
    }
    env.be->gemm_grouped(problems, ta, tb, 1.0f, beta);
  }
};

// The experts' weight gradients dW_e += dY_e^T X_e (A: rows of dY in `dy` [a_len], B: rows of X
// in `x` [b_len elements]) now — from `dy_c`, dy already in the GEMMs' type (round_once) — or,
// under a WeightGradDeferral, later, from copies of dy and x where later kernels overwrite them.
void run_weight_grads(const LayerEnv& env, Group g, const float* dy, kernels::ConstView dy_c, int64_t a_len,
                      kernels::ConstView x, int64_t b_len) {
  if (g.C.empty()) return;
  WeightGradDeferral* d = WeightGradDeferral::active();
  if (!d) return g.run(env, dy_c, a_len, x, b_len, true, false, 1.0f);
  DS_CHECK(dy, "a deferred experts' weight gradient needs its fp32 dy");
  auto dyc = d->keep(dy, a_len);
  auto xc = d->keep(x, b_len * kernels::dtype_size(x.dtype));
  d->push([env, g = std::move(g), dyc, xc, a_len, b_len] {
    g.run(env, kernels::f32(dyc.data), a_len, xc.view, b_len, true, false, 1.0f);
  });
}

thread_local WeightGradDeferral* g_active_deferral = nullptr;

}  // namespace

WeightGradDeferral* WeightGradDeferral::active() { return g_active_deferral; }
WeightGradDeferral::Scope::Scope(WeightGradDeferral* d) : prev_(g_active_deferral) { g_active_deferral = d; }
WeightGradDeferral::Scope::~Scope() { g_active_deferral = prev_; }

// Experts [e_first, e_first + ne) on rows X grouped by expert (cnt[e - e_first] rows from
// off[e - e_first]): GU = X W_gu^T, M = swiglu(GU), Y = M W_d^T, as grouped GEMMs. Experts this
// rank does not hold (no parameters) are skipped.
void MoeLayer::experts_forward(kernels::ConstView X, float* GU, kernels::View M, float* Y, const int64_t* cnt,
                               const int64_t* off, int64_t e_first, int64_t ne, int64_t rows) {
  Group g1, g2;
  for (int64_t i = 0; i < ne; ++i) {
    const int64_t e = e_first + i, o = off[i], c = cnt[i];
    if (!gate_up_[size_t(e)] || c == 0) continue;
    g1.add_forward(GU + o * 2 * I_, o * H_, gate_up_[size_t(e)], c);
    g2.add_forward(Y + o * H_, o * I_, down_[size_t(e)], c);
  }
  if (g1.C.empty()) return;
  g1.run(env_, X, rows * H_, {}, 0, false, true, 0.0f);
  swiglu_into(M, GU, rows);
  g2.run(env_, {M.data, M.dtype}, rows * I_, {}, 0, false, true, 0.0f);
}

// Backward of experts_forward: dX from dY, the weight gradients accumulated (or queued under a
// WeightGradDeferral). dM [rows, I] and dGU [rows, 2I] are work buffers; dX may be dY.
bool MoeLayer::producers_write_16bit() const {
  return env_.cast && env_.cast->active() && !WeightGradDeferral::active();
}

void MoeLayer::experts_backward(float* dX, const float* dY, kernels::ConstView X, const float* GU, kernels::ConstView M,
                                float* dM, float* dGU, const int64_t* cnt, const int64_t* off, int64_t e_first,
                                int64_t ne, int64_t rows, kernels::ConstView dY16) {
  kernels::Backend& be = *env_.be;
  Group gdM, gdWd;
  for (int64_t i = 0; i < ne; ++i) {
    const int64_t e = e_first + i, o = off[i], c = cnt[i];
    if (!gate_up_[size_t(e)] || c == 0) continue;
    gdM.add_input_grad(dM + o * I_, o * H_, down_[size_t(e)], c);  // dM = dY W_d
    gdWd.add_weight_grad(down_[size_t(e)], o * H_, o * I_, c);      // dW_d += dY^T M
  }
  if (gdM.C.empty()) return;
  // dY and dGU each feed two grouped GEMMs (dX, dW): rounded once, in slot 0, which neither
  // weight-gradient GEMM's other input (slot 1 or none) touches.
  DS_CHECK(dY || dY16.data, "experts_backward: no dY");
  const kernels::ConstView dYc = dY16.data ? dY16 : round_once(env_, 0, dY, rows * H_);
  gdM.run(env_, dYc, rows * H_, {}, 0, false, false, 0.0f);
  env_.poll();
  run_weight_grads(env_, gdWd, dY, dYc, rows * H_, M, rows * I_);
  env_.poll();
  // dGU is read by the two GEMMs below only: on 16-bit GEMMs swiglu's backward writes it rounded,
  // in slot 0 (dYc is dead by now), as round_once would have made it from the fp32 values. Not
  // under a WeightGradDeferral, whose queued GEMM keeps (and later rounds) the fp32 dGU.
  const bool dgu_lp = producers_write_16bit();
  kernels::ConstView dGUc;
  if (dgu_lp) {
    const kernels::View v = env_.cast->slot_view(0, rows * 2 * I_);
    be.swiglu_backward({v, {rows, 2 * I_}}, {dM, {rows, I_}}, {GU, {rows, 2 * I_}});
    dGUc = {v.data, v.dtype};
  } else {
    be.swiglu_backward({dGU, {rows, 2 * I_}}, {dM, {rows, I_}}, {GU, {rows, 2 * I_}});
    dGUc = round_once(env_, 0, dGU, rows * 2 * I_);
  }
  Group gdX, gdWgu;
  for (int64_t i = 0; i < ne; ++i) {
    const int64_t e = e_first + i, o = off[i], c = cnt[i];
    if (!gate_up_[size_t(e)] || c == 0) continue;
    gdX.add_input_grad(dX + o * H_, o * 2 * I_, gate_up_[size_t(e)], c);       // dX = dGU W_gu
    gdWgu.add_weight_grad(gate_up_[size_t(e)], o * 2 * I_, o * H_, c);         // dW_gu += dGU^T X
  }
  gdX.run(env_, dGUc, rows * 2 * I_, {}, 0, false, false, 0.0f);
  env_.poll();
  run_weight_grads(env_, gdWgu, dgu_lp ? nullptr : dGU, dGUc, rows * 2 * I_, X, rows * H_);
  env_.poll();
}

void MoeLayer::backward(float* du_full, const float* dout_full, const float* u_full, const float* u_part,
                        TokenPart part, int64_t B, int64_t S) {
  kernels::Backend& be = *env_.be;
  Scratch& scratch = *env_.scratch;
  scratch.reset();
  const int64_t N = B * S, n = part.count, rows = n * k_;
  float* dYp = scratch.take(rows * H_);
  float* dw = scratch.take(n * k_);
  // On 16-bit GEMMs, with the experts here, the combine's backward writes dY rounded (slot 0)
  // for the experts' GEMMs, the only readers; dYp's fp32 space then holds only dX.
  const bool dy_lp = ep_ == 1 && producers_write_16bit();
  kernels::ConstView dY16;
  if (dy_lp) {
    const kernels::View v = env_.cast->slot_view(0, rows * H_);
    be.moe_combine_backward({v, {n * k_, H_}}, {dw, {n, k_}}, {dout_full + part.first * H_, {n, H_}},
                            {Yp_.data(), {n * k_, H_}}, {w_.data(), {n, k_}}, {pos_dev_.data(), {n, k_}});
    dY16 = {v.data, v.dtype};
  } else {
    be.moe_combine_backward({dYp, {n * k_, H_}}, {dw, {n, k_}}, {dout_full + part.first * H_, {n, H_}},
                            {Yp_.data(), {n * k_, H_}}, {w_.data(), {n, k_}}, {pos_dev_.data(), {n, k_}});
  }
  float* dXp = dYp;  // dYp is dead once the experts' dM exists; same size [rows, H]
  if (ep_ == 1) {
    float* dMp = scratch.take(rows * I_);
    float* dGUp = scratch.take(rows * 2 * I_);
    if (rows > 0 && counts_.size() > 0)
      experts_backward(dXp, dy_lp ? nullptr : dYp, {Xp_.raw(), Xp_.dtype()}, GUp_.data(), {Mp_.raw(), Mp_.dtype()},
                       dMp, dGUp, counts_.data(), offsets_.data(), 0, E_, rows, dY16);
    if (shared_) shared_->backward(du_full, dout_full, u_full, N, 0.0f);
    else
      be.fill({du_full, {N * H_}}, 0.0f);
  } else {
    // The output gradients go to the experts' owners (the forward's exchange in reverse), the
    // input gradients come back. The received-side buffers are the instance's, shared by its
    // MoE layers (a zero-bubble W queue copies what it keeps from them).
    const int64_t recv = recv_total_;
    EpBackwardBuffers& b = *env_.ep_bwd;
    for (kernels::DeviceArray<float>* v : {&b.dYr, &b.dYe}) v->resize(be, recv * H_);
    b.dMe.resize(be, recv * I_), b.dGUe.resize(be, recv * 2 * I_);
    auto out = env_.coll->ep_all_to_all_v(b.dYr.data(), scaled(recv_rows_, H_), dYp, scaled(send_rows_, H_));
    if (shared_) shared_->backward(du_full, dout_full, u_full, N, 0.0f);  // while the gradients travel
    else
      be.fill({du_full, {N * H_}}, 0.0f);
    if (out) out->wait();
    be.gather_rows({b.dYe.data(), {recv, H_}}, {b.dYr.data(), {recv, H_}}, {to_source_dev_.data(), {recv}});
    float* dXe = b.dYr.data();  // dYr is read: its space takes the experts' input gradients
    experts_backward(dXe, b.dYe.data(), kernels::f32(Xe_->data()), GUe_->data(), kernels::f32(Me_->data()),
                     b.dMe.data(), b.dGUe.data(), ecounts_.data(), eoffsets_.data(), e0_, El_, recv);
    float* dXr = b.dYe.data();  // and dYe's (read by the experts' backward; a W queue copied what it keeps)
    be.gather_rows({dXr, {recv, H_}}, {dXe, {recv, H_}}, {to_expert_dev_.data(), {recv}});
    auto back = env_.coll->ep_all_to_all_v(dXp, scaled(send_rows_, H_), dXr, scaled(recv_rows_, H_));
    if (back) back->wait();
  }
  float* du_part = du_full + part.first * H_;
  be.moe_dispatch_backward({du_part, {n, H_}}, {dXp, {n * k_, H_}}, {pos_dev_.data(), {n, k_}});
  float* dlogits = scratch.take(n * E_);
  be.router_backward({dlogits, {n, rp_.num_experts}}, {dw, {n, rp_.top_k}}, {dscores_.data(), {n, rp_.num_experts}},
                     {scores_.data(), {n, rp_.num_experts}}, {idx_dev_.data(), {n, rp_.top_k}}, rp_);
  if (env_.tp_size == 1) {
    gate_.backward(env_, du_part, dlogits, u_part, n, 1.0f);
  } else {  // the router is replicated: its gradient from this rank's tokens, summed over the ranks
    float* dgate = scratch.take(E_ * H_);
    be.fill({dgate, {E_ * H_}}, 0.0f);
    const WeightGradDeferral::Scope now(nullptr);  // reduced at once: never deferred
    gate_.backward(env_, du_part, dlogits, u_part, n, 1.0f, dgate);
    env_.coll->tp_all_reduce(dgate, E_ * H_);
    be.add({gate_.weight().g, {E_ * H_}}, {dgate, {E_ * H_}});
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
