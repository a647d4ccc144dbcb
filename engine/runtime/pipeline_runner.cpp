#include "engine/runtime/pipeline_runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "engine/common/error.h"
#include "engine/common/trace.h"
#include "engine/runtime/rank_engine.h"

namespace dstrain::runtime {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

bool is_compute(plan::PipeOp op) {
  using plan::PipeOp;
  return op == PipeOp::kForward || op == PipeOp::kBackward || op == PipeOp::kBackwardInput ||
         op == PipeOp::kBackwardWeight;
}

}  // namespace

PipelineRunner::PipelineRunner(const plan::ParallelPlan& plan, const RankGroups& groups, kernels::Backend& be,
                               model::Collectives& coll, model::ParamStore& params, int64_t micro_batch,
                               int64_t micro_batches)
    : plan_(plan), be_(be), coll_(coll), params_(params), micro_batch_(micro_batch),
      seq_(plan.config.seq_length), p_(plan.degrees.pp), r_(groups.coord().pp), v_(plan.chunks()) {
  const config::TrainConfig& cfg = plan.config;
  const config::ModelConfig& m = cfg.model;
  schedule_ = plan::make_schedule(cfg.parallel.pipeline_schedule, p_, int(micro_batches), v_);
  zero_bubble_ = cfg.parallel.pipeline_schedule == config::PipelineScheduleKind::kZbH1;
  // On device memory the transfers follow NCCL's ordering: a communicator's operations run one
  // after another, so a receive posted ahead would hold the sends behind it until its peer
  // answers, and two stages that each send before they receive would wait on each other. There
  // receives are issued when they are needed, in one group with the sends made since the last
  // one (as Megatron batches its send / receive pairs).
  grouped_ = p_ > 1 && !be.host_addressable();
  if (p_ > 1) {
    const comm::CommOptions o{cfg.parallel.comm_timeout_s};
    const comm::ProcessGroup& g = groups.group(plan::Axis::kPipeline);
    act_ = make_communicator(g, "pp-act", o, be);
    grad_ = make_communicator(g, "pp-grad", o, be);
    embed_ = make_communicator(g, "pp-embed", o, be);
  }
  // The embedding's mirror: the last stage runs MTP modules without holding the embedding.
  const bool mtp = m.num_nextn_predict_layers > 0;
  const int last_rank = p_ - 1;
  if (mtp && p_ > 1) {
    const int64_t block = plan::vocab_block(m.vocab_size, plan.degrees.tp);
    const int64_t v0 = std::min<int64_t>(m.vocab_size, int64_t(coll.tp_rank()) * block);
    mirror_len_ = (std::min<int64_t>(m.vocab_size, v0 + block) - v0) * m.hidden_size;
    mirror_holder_ = r_ == last_rank;
    mirror_source_ = r_ == 0;
    // The weights travel as the model reads them: fp32, or the 16-bit compute copy (two to a word).
    mirror_dtype_ = params.compute_dtype();
    mirror_words_ = mirror_dtype_ == kernels::DType::kF32 ? mirror_len_ : (mirror_len_ + 1) / 2;
    if (mirror_holder_) mirror_w_.resize(be, mirror_words_), mirror_g_.resize(be, mirror_len_);
    if (mirror_source_) mirror_in_.resize(be, mirror_len_);
  }
  for (int c = 0; c < v_; ++c) {
    Chunk ch;
    ch.virtual_stage = c * p_ + r_;
    const plan::StageRange& s = plan.stages.at(size_t(ch.virtual_stage));
    ch.spec.first_layer = s.first_layer, ch.spec.end_layer = s.end_layer;
    ch.spec.embedding = s.has_embedding, ch.spec.head = s.has_head;
    if (s.has_head && !s.has_embedding && mtp) ch.spec.embed_table = {mirror_w_.data(), mirror_dtype_}, ch.spec.embed_g = mirror_g_.data();
    ch.spec.recompute = model::recompute_mode(cfg.activation_checkpointing);
    ch.spec.recompute_layers = cfg.activation_checkpointing.num_layers.value_or(-1);
    ch.spec.recompute_arena = recompute_arena_;  // every instance of this rank, one at a time
    ch.spec.workspace = workspace_;
    ch.spec.loss_chunk_rows = cfg.kernels.loss_chunk_tokens;
    chunks_.push_back(std::move(ch));
  }
  for (int c = 0; c < v_; ++c) release(c, acquire(c));  // one instance per chunk now; more as the schedule needs
  tokens_.resize(size_t(micro_batch_ * (seq_ + 1)));
}

PipelineRunner::~PipelineRunner() {
  // Sends in flight read buffers owned here. (A failed transfer was reported by whoever waited
  // on it, or is being reported now: a destructor must not throw.)
  for (auto& s : sends_) {
    if (!s.work) continue;
    try {
      s.work->wait();
    } catch (...) {
    }
  }
}

int PipelineRunner::acquire(int chunk) {
  Chunk& ch = chunks_[size_t(chunk)];
  if (!ch.free.empty()) {
    const int slot = ch.free.back();
    ch.free.pop_back();
    return slot;
  }
  const config::TrainConfig& cfg = plan_.config;
  ch.pool.push_back(std::make_unique<model::DeepSeekModel>(cfg.model, be_, coll_, params_, micro_batch_, seq_,
                                                           cfg.parallel.sequence_parallel, ch.spec));
  ch.pool.back()->set_backward_observer(this);
  ch.deferred.push_back(std::make_unique<model::WeightGradDeferral>(be_));
  ch.pool.back()->mark_workspace_volatile(*ch.deferred.back());
  return int(ch.pool.size()) - 1;
}

void PipelineRunner::release(int chunk, int slot) { chunks_[size_t(chunk)].free.push_back(slot); }

std::vector<model::MoeLayer*> PipelineRunner::all_moe_layers() {
  std::vector<model::MoeLayer*> out;
  for (Chunk& ch : chunks_)
    for (auto& inst : ch.pool)
      for (auto* moe : inst->moe_layers()) out.push_back(moe);
  return out;
}

std::vector<std::pair<int64_t, model::MoeLayer*>> PipelineRunner::moe_layers_by_id() {
  std::vector<std::pair<int64_t, model::MoeLayer*>> out;
  for (Chunk& ch : chunks_) {
    model::DeepSeekModel& first = *ch.pool.at(0);
    const auto ids = first.moe_layer_ids();
    const auto layers = first.moe_layers();
    for (size_t i = 0; i < ids.size(); ++i) out.emplace_back(ids[i], layers[i]);
  }
  return out;
}

std::vector<std::pair<int64_t, std::vector<int64_t>>> PipelineRunner::expert_loads() {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> out;
  for (Chunk& ch : chunks_)
    for (auto& inst : ch.pool) {
      const auto ids = inst->moe_layer_ids();
      const auto layers = inst->moe_layers();
      for (size_t i = 0; i < ids.size(); ++i) out.emplace_back(ids[i], layers[i]->stats().loads);
    }
  return out;
}

int64_t PipelineRunner::saved_activation_bytes_per_micro() const {
  int64_t total = 0;
  for (const Chunk& ch : chunks_) total += ch.pool.at(0)->saved_activation_bytes();
  return total;
}

int64_t PipelineRunner::saved_activation_bytes_held() const {
  int64_t total = recompute_arena_->bytes();
  for (const Chunk& ch : chunks_)
    for (const auto& inst : ch.pool) total += inst->own_activation_bytes();
  return total;
}

int64_t PipelineRunner::deferred_copy_bytes_peak() const {
  int64_t bytes = 0;
  for (const Chunk& ch : chunks_)
    for (const auto& d : ch.deferred) bytes += d->peak_held_bytes();
  return bytes;
}

int64_t PipelineRunner::activation_bytes_held() const {
  int64_t total = recompute_arena_->bytes() + workspace_->bytes();
  for (const Chunk& ch : chunks_)
    for (const auto& inst : ch.pool) total += inst->own_activation_bytes() + inst->own_workspace_bytes();
  return total;
}

int64_t PipelineRunner::instances() const {
  int64_t n = 0;
  for (const Chunk& ch : chunks_) n += int64_t(ch.pool.size());
  return n;
}

void PipelineRunner::grads_final(int64_t layer) {
  if (!armed_ && !(observer_ && observer_->every_micro_batch())) return;
  if (armed_ && layer == -1 && mirror_source_) {  // the mirror's gradient first (the last stage's MTP modules)
    embed_->recv(mirror_in_.data(), mirror_len_, p_ - 1)->wait();
    be_.add({params_.grad("model.embed_tokens.weight"), {mirror_len_}}, {mirror_in_.data(), {mirror_len_}});
  }
  if (observer_) observer_->grads_final(layer);
}

void PipelineRunner::poll() {
  if (observer_) observer_->poll();
  if (act_) act_->progress(), grad_->progress();
}

// Posts the receives listed from `from` to the next compute op: called as the compute op before
// them starts, so that they are in flight while it computes.
void PipelineRunner::post_receives(size_t from) {
  const auto& list = schedule_.ranks[size_t(r_)];
  size_t i = std::max(posted_, from);
  for (; i < list.size() && !is_compute(list[i].op); ++i) {
    const plan::PipeInstr& in = list[i];
    const bool grad = in.op == plan::PipeOp::kRecvGradient;
    if (!grad && in.op != plan::PipeOp::kRecvActivation) continue;
    const model::DeepSeekModel& any = *chunks_[size_t(in.chunk)].pool.at(0);
    const int64_t n = any.boundary_rows() * plan_.config.model.hidden_size;
    Pending& p = receives_[{in.micro, in.chunk, grad}];
    p.buf.resize(be_, n);
    p.peer = in.peer, p.n = n, p.grad = grad;
    if (!grouped_) p.work = (grad ? grad_ : act_)->recv(p.buf.data(), n, in.peer);  // (grouped: at its wait)
  }
  posted_ = std::max(posted_, i);
}

const float* PipelineRunner::wait_receive(int micro, int chunk, bool grad, double& wait_s) {
  Pending& p = receives_.at({micro, chunk, grad});
  const auto t = Clock::now();
  if (!p.work) {  // grouped: the receive now, with the sends made since the last one
    act_->group_start(), grad_->group_start();
    for (Pending& s : unsent_) s.work = (s.grad ? grad_ : act_)->send(s.buf.data(), s.n, s.peer);
    p.work = (p.grad ? grad_ : act_)->recv(p.buf.data(), p.n, p.peer);
    grad_->group_end(), act_->group_end();
    for (Pending& s : unsent_) sends_.push_back(std::move(s));
    unsent_.clear();
  }
  p.work->wait();
  wait_s += seconds_since(t);
  return p.buf.data();
}

void PipelineRunner::send(bool grad, int peer, const float* src, int64_t n) {
  Pending s;
  s.buf.resize(be_, n);
  be_.copy(s.buf.data(), src, n * int64_t(sizeof(float)));
  s.peer = peer, s.n = n, s.grad = grad;
  if (grouped_) {
    unsent_.push_back(std::move(s));
    return;
  }
  s.work = (grad ? grad_ : act_)->send(s.buf.data(), n, peer);
  sends_.push_back(std::move(s));
}

void PipelineRunner::flush_sends() {
  if (unsent_.empty()) return;
  act_->group_start(), grad_->group_start();
  for (Pending& s : unsent_) s.work = (s.grad ? grad_ : act_)->send(s.buf.data(), s.n, s.peer);
  grad_->group_end(), act_->group_end();
  for (Pending& s : unsent_) sends_.push_back(std::move(s));
  unsent_.clear();
}

void PipelineRunner::reap_sends(bool all) {
  std::vector<Pending> in_flight;
  for (auto& s : sends_) {
    if (all) s.work->wait();
    else if (!s.work->done()) in_flight.push_back(std::move(s));
  }
  sends_ = std::move(in_flight);
}

PipelineStepResult PipelineRunner::run(const Fetch& fetch, const model::LossScale& scale,
                                       model::BackwardObserver* observer,
                                       const std::function<double()>& finish_reduction) {
  using plan::PipeOp;
  PipelineStepResult r;
  const auto start = Clock::now();
  observer_ = observer;
  armed_ = false;
  posted_ = 0;
  const int m = schedule_.micro;
  // The mirror's weights (the first stage's embedding shard after the last optimizer step).
  if (mirror_source_)
    mirror_work_ = embed_->send(mirror_weights(), mirror_words_, p_ - 1);
  if (mirror_holder_) {
    embed_->recv(mirror_w_.data(), mirror_words_, 0)->wait();
    be_.fill({mirror_g_.data(), {mirror_len_}}, 0.0f);
  }
  const auto& list = schedule_.ranks[size_t(r_)];
  post_receives(0);  // those before the first compute op
  double end_of_compute = 0;
  for (size_t k = 0; k < list.size(); ++k) {
    const plan::PipeInstr& in = list[k];
    Chunk& ch = chunks_[size_t(std::max(0, in.chunk))];
    const bool last_vs = ch.virtual_stage == p_ * v_ - 1, first_vs = ch.virtual_stage == 0;
    switch (in.op) {
      case PipeOp::kRecvActivation:
      case PipeOp::kRecvGradient:
        break;  // posted ahead (post_receives); waited for by the op that needs it
      case PipeOp::kForward: {
        post_receives(k + 1);
        const float* h_in = first_vs ? nullptr : wait_receive(in.micro, in.chunk, false, r.wait_s);
        fetch(in.micro, tokens_.data());
        const int slot = acquire(in.chunk);
        active_[{in.micro, in.chunk}] = slot;
        const auto tc = Clock::now();
        const trace::Scope t("pipeline", "forward micro-batch", in.micro);
        const model::Losses l = ch.pool[size_t(slot)]->forward_stage(tokens_.data(), h_in, scale);
        r.forward_s += seconds_since(tc);
        r.loss.ce += l.ce, r.loss.aux += l.aux, r.loss.mtp += l.mtp;
        ++r.forwards;
        if (!first_vs) receives_.erase({in.micro, in.chunk, false});
        break;
      }
      case PipeOp::kBackward:
      case PipeOp::kBackwardInput: {
        post_receives(k + 1);
        const float* dh = last_vs ? nullptr : wait_receive(in.micro, in.chunk, true, r.wait_s);
        const int slot = active_.at({in.micro, in.chunk});
        armed_ = in.micro == m - 1;
        const auto tc = Clock::now();
        {
          const trace::Scope t("pipeline", in.op == PipeOp::kBackwardInput ? "input-gradient backward micro-batch"
                                                                           : "backward micro-batch",
                               in.micro);
          const model::WeightGradDeferral::Scope defer(
              in.op == PipeOp::kBackwardInput ? ch.deferred[size_t(slot)].get() : nullptr);
          ch.pool[size_t(slot)]->backward_stage(dh);
        }
        r.backward_s += seconds_since(tc);
        // A sync that reduces every micro-batch (ZeRO-2 holding a shard; whole backward passes
        // only) lands this one's buckets before the next backward writes gradients.
        if (in.op == PipeOp::kBackward && !armed_ && observer_ && observer_->every_micro_batch()) {
          const auto tw = Clock::now();
          observer_->micro_batch_done();
          r.comm_wait_s += seconds_since(tw);
        }
        armed_ = false;
        ++r.backwards;
        if (!last_vs) receives_.erase({in.micro, in.chunk, true});
        if (in.op == PipeOp::kBackward && first_vs) {  // nothing to send: the instance is free
          active_.erase({in.micro, in.chunk});
          release(in.chunk, slot);
        }
        break;
      }
      case PipeOp::kBackwardWeight: {
        post_receives(k + 1);
        const int slot = active_.at({in.micro, in.chunk});
        armed_ = in.micro == m - 1;
        const auto tc = Clock::now();
        {
          const trace::Scope t("pipeline", "weight-gradient backward micro-batch", in.micro);
          ch.deferred[size_t(slot)]->run();
        }
        r.weight_s += seconds_since(tc);
        armed_ = false;
        ++r.weights;
        active_.erase({in.micro, in.chunk});
        release(in.chunk, slot);
        break;
      }
      case PipeOp::kSendActivation:
      case PipeOp::kSendGradient: {
        const bool grad = in.op == PipeOp::kSendGradient;
        const int slot = active_.at({in.micro, in.chunk});
        const model::DeepSeekModel& inst = *ch.pool[size_t(slot)];
        const int64_t n = inst.boundary_rows() * plan_.config.model.hidden_size;
        send(grad, in.peer, grad ? inst.input_grad() : inst.output(), n);
        if (grad && !zero_bubble_) {  // the backward is complete: the instance is free
          active_.erase({in.micro, in.chunk});
          release(in.chunk, slot);
        }
        reap_sends(false);
        break;
      }
      case PipeOp::kReduceGradients: {
        end_of_compute = seconds_since(start);
        flush_sends();
        if (mirror_holder_) embed_->send(mirror_g_.data(), mirror_len_, 0)->wait();
        if (mirror_work_) mirror_work_->wait(), mirror_work_.reset();
        reap_sends(true);
        observer_ = nullptr;
        if (finish_reduction) r.comm_wait_s += finish_reduction();
        break;
      }
      case PipeOp::kOptimizerStep:
        break;  // the caller's, after the gradients are reduced
    }
  }
  // ZB-H1's first stage sends its mirror gradient only at the reduce; the wait happens there.
  DS_CHECK(unsent_.empty(), "pipeline step ended with {} transfers never issued", unsent_.size());
  DS_CHECK(active_.empty() && receives_.empty(), "pipeline step ended with {} micro-batches in flight, {} receives",
           active_.size(), receives_.size());
  r.span_s = end_of_compute > 0 ? end_of_compute : seconds_since(start);
  r.busy_s = r.forward_s + r.backward_s + r.weight_s;
  observer_ = nullptr;
  return r;
}

// The first stage's embedding shard as the mirror's words (fp32, or the compute copy's 16-bit
// values two to a word; an odd count's last word carries the next element of the flat buffer,
// which the holder never reads).
const float* PipelineRunner::mirror_weights() const {
  const std::string name = "model.embed_tokens.weight";
  if (mirror_dtype_ == kernels::DType::kF32) return params_.param(name);
  const uint16_t* lp = params_.compute_values(name);
  DS_CHECK(reinterpret_cast<uintptr_t>(lp) % 4 == 0, "the embedding's compute copy is not word-aligned");
  return reinterpret_cast<const float*>(lp);
}

model::Losses PipelineRunner::forward_only(int64_t micro_batches, const Fetch& fetch, const model::LossScale& scale) {
  model::Losses out;
  if (mirror_source_) embed_->send(mirror_weights(), mirror_words_, p_ - 1)->wait();
  if (mirror_holder_) embed_->recv(mirror_w_.data(), mirror_words_, 0)->wait();
  kernels::DeviceArray<float> in;
  for (int64_t micro = 0; micro < micro_batches; ++micro) {
    fetch(micro, tokens_.data());
    for (int c = 0; c < v_; ++c) {
      Chunk& ch = chunks_[size_t(c)];
      model::DeepSeekModel& inst = *ch.pool.at(0);
      const int vs = ch.virtual_stage;
      const int64_t n = inst.boundary_rows() * plan_.config.model.hidden_size;
      if (vs > 0) {
        in.resize(be_, n);
        act_->group_start(), grad_->group_start();  // (the sends kept since the last receive with it)
        for (Pending& s : unsent_) s.work = (s.grad ? grad_ : act_)->send(s.buf.data(), s.n, s.peer);
        auto r = act_->recv(in.data(), n, (vs - 1) % p_);
        grad_->group_end(), act_->group_end();
        for (Pending& s : unsent_) sends_.push_back(std::move(s));
        unsent_.clear();
        r->wait();
      }
      const model::Losses l = inst.forward_stage(tokens_.data(), vs > 0 ? in.data() : nullptr, scale);
      out.ce += l.ce, out.aux += l.aux, out.mtp += l.mtp;
      if (vs + 1 < p_ * v_) send(false, (vs + 1) % p_, inst.output(), n);
    }
  }
  flush_sends();
  reap_sends(true);
  return out;
}

}  // namespace dstrain::runtime
