// What every layer needs: the model's dimensions (local to this rank's tensor-parallel shard),
// the backend, the collectives, the parameters, and a scratch area for backward temporaries.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/common/error.h"
#include "engine/config/train_config.h"
#include "engine/model/activations.h"
#include "engine/model/collectives.h"
#include "engine/model/param_store.h"

namespace dstrain::model {

// Bump allocator over one buffer from the backend, reset by each backward (temporaries never
// outlive a layer).
class Scratch {
 public:
  void reserve(kernels::Backend& be, int64_t floats) {
    if (floats <= capacity()) return;
    buf_ = kernels::DeviceBuffer(be, floats * int64_t(sizeof(float)));
    be.fill({buf_.as<float>(), {floats}}, 0.0f);
  }
  void reset() { used_ = 0; }
  float* take(int64_t n) {
    DS_CHECK(used_ + n <= capacity(), "scratch overflow: {} + {} > {}", used_, n, capacity());
    float* p = buf_.as<float>() + used_;
    used_ += (n + 15) / 16 * 16;  // keep 64-byte alignment of later takes
    return p;
  }
  int64_t capacity() const { return buf_.bytes() / int64_t(sizeof(float)); }
  const float* data() const { return buf_.as<float>(); }
  const kernels::DeviceBuffer& buffer() const { return buf_; }  // (replaced when reserve grows it)

 private:
  kernels::DeviceBuffer buf_;
  int64_t used_ = 0;
};

// What the backward pass tells whoever reduces the gradients (the data-parallel gradient sync,
// engine/parallel/grad_sync.h) without the model seeing any communicator: that a part's
// gradients are final, and — between kernels — chances to advance communication in flight.
class BackwardObserver {
 public:
  virtual ~BackwardObserver() = default;
  // The gradients of layer `layer` (plan::ParamInfo::layer numbering) are final.
  virtual void grads_final(int64_t layer) = 0;
  virtual void poll() = 0;
  // Whether it reduces every micro-batch's gradients (ZeRO-2 holding a shard), not only the last
  // one's: then it is told every micro-batch's final layers, and micro_batch_done() after each
  // backward pass but the step's last, before the next one writes gradients.
  virtual bool every_micro_batch() const { return false; }
  virtual void micro_batch_done() {}
};

// Zero-bubble pipeline schedules (docs/design.md §6.6) split a backward pass into B, the input
// gradients, and W, the weight gradients, run later. While a deferral is active (Scope, on this
// thread), Linear::backward and the experts' grouped weight GEMMs queue their weight-gradient
// GEMMs here, and the "gradients final" notices queue behind them; run() is W. Every
// parameter's gradient still receives its micro-batches' terms in micro-batch order, as without
// the split. A GEMM input inside one of the volatile ranges (the model instance's workspace,
// which later kernels of B overwrite) is copied; any other input is a saved activation of the
// instance, which stays as it is until the instance is released after W, and is read in place.
class WeightGradDeferral {
 public:
  // Copies are made in `be`'s memory. On a backend whose memory the host cannot address (a GPU)
  // each keep() copies anew; on the host, inputs several GEMMs read are copied once (compared
  // byte for byte).
  explicit WeightGradDeferral(kernels::Backend& be) : be_(&be) {}
  static WeightGradDeferral* active();
  class Scope {  // makes `d` (null: none) the active deferral until destroyed
   public:
    explicit Scope(WeightGradDeferral* d);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WeightGradDeferral* prev_;
  };
  void push(std::function<void()> op) { ops_.push_back(std::move(op)); }
  // [begin, end) ranges of floats that B overwrites after it has queued a GEMM reading them.
  void add_volatile(const float* begin, int64_t n) {
    if (n > 0) volatile_.push_back({begin, begin + n});
  }
  // The same for an array that may be resized (and moved) between now and a keep().
  void add_volatile(const kernels::DeviceArray<float>* v) { volatile_vectors_.push_back(v); }
  // And for a device buffer that may be replaced by a larger one.
  void add_volatile(const kernels::DeviceBuffer* b) { volatile_buffers_.push_back(b); }
  // n floats at p as W will read them: p itself, or a copy (kept alive with the queued GEMM)
  // when they lie in a volatile range.
  struct Kept {
    std::shared_ptr<kernels::DeviceBuffer> copy;
    const float* data = nullptr;
  };
  Kept keep(const float* p, int64_t n) {
    KeptView k = keep(kernels::f32(p), n * int64_t(sizeof(float)));
    return {k.copy, static_cast<const float*>(k.view.data)};
  }
  // The same for `bytes` bytes of a typed buffer (a 16-bit saved activation).
  struct KeptView {
    std::shared_ptr<kernels::DeviceBuffer> copy;
    kernels::ConstView view;
  };
  KeptView keep(kernels::ConstView v, int64_t bytes) {
    const char* p = static_cast<const char*>(v.data);
    const auto overlaps = [&](const void* b, const void* e) {
      return p < static_cast<const char*>(e) && p + bytes > static_cast<const char*>(b);
    };
    bool copy = false;
    for (const auto& [b, e] : volatile_) copy = copy || overlaps(b, e);
    for (const kernels::DeviceArray<float>* w : volatile_vectors_)
      copy = copy || overlaps(w->data(), w->data() + w->size());
    for (const kernels::DeviceBuffer* b : volatile_buffers_)
      copy = copy || overlaps(b->data(), static_cast<const char*>(b->data()) + b->bytes());
    if (!copy) return {nullptr, v};
    // Several queued GEMMs read the same input (a layer's normed input feeds three): one copy,
    // shared while the bytes there are still those copied.
    if (be_->host_addressable())
      for (const auto& [q, c] : copies_)
        if (q == p && c->bytes() == bytes && std::memcmp(c->data(), p, size_t(bytes)) == 0)
          return {c, {c->data(), v.dtype}};
    auto c = std::make_shared<kernels::DeviceBuffer>(*be_, bytes);
    be_->copy(c->data(), p, bytes);
    copies_.emplace_back(p, c);
    copied_ += bytes;
    held_ += bytes;
    peak_held_ = std::max(peak_held_, held_);
    return {c, {c->data(), v.dtype}};
  }
  int64_t copied_bytes() const { return copied_; }
  // The most bytes of copies queued at once (held from B until W ran them).
  int64_t peak_held_bytes() const { return peak_held_; }
  void run() {
    for (auto& op : ops_) op();
    ops_.clear();
    copies_.clear();
    held_ = 0;
  }
  bool empty() const { return ops_.empty(); }

 private:
  std::vector<std::function<void()>> ops_;
  std::vector<std::pair<const float*, const float*>> volatile_;
  std::vector<const kernels::DeviceArray<float>*> volatile_vectors_;
  std::vector<const kernels::DeviceBuffer*> volatile_buffers_;
  kernels::Backend* be_;
  std::vector<std::pair<const char*, std::shared_ptr<kernels::DeviceBuffer>>> copies_;  // queued since run()
  int64_t copied_ = 0, held_ = 0, peak_held_ = 0;  // bytes
};

// Shared by the model and its layers; `observer` may change between backward passes (a
// deferred notice reads it when W runs).
struct Progress {
  BackwardObserver* observer = nullptr;
  void poll() const {
    if (observer) observer->poll();
  }
  void grads_final(int64_t layer) const {
    if (WeightGradDeferral* d = WeightGradDeferral::active()) {
      d->push([this, layer] {
        if (observer) observer->grads_final(layer);
      });
      return;
    }
    if (observer) observer->grads_final(layer);
  }
};

// The rows [first, first + count) of a micro-batch's N tokens that one tensor-parallel rank
// handles where the work is split by tokens: the routed experts always (expert-TP = 1: each rank
// runs the router and the experts on its part, no token on two ranks), and the norm and residual
// regions under sequence parallelism. Contiguous parts of ceil(N / tp) rows, the last shorter.
struct TokenPart {
  int64_t first = 0, count = 0;
};
inline TokenPart token_part(int64_t N, int tp_size, int tp_rank) {
  const int64_t block = (N + tp_size - 1) / tp_size;
  const int64_t first = std::min(N, tp_rank * block);
  return {first, std::min(N, first + block) - first};
}

// The compute type of the GEMMs (docs/design.md §6.10): under bf16 / fp16 every linear layer
// multiplies its input, rounded to the compute type here, by the parameter's 16-bit compute copy
// (ParamStore::compute_param), accumulating in fp32 into an fp32 output. Each call converts into
// one of a few device workspaces (grown to the largest call, during the first step), so a
// GEMM's inputs are converted right before it: the same inputs give the same bits, wherever
// the GEMM runs (a recomputation, a deferred weight-gradient GEMM). fp32 converts nothing.
// The GEMMs always take 16-bit operands: where a device's 16-bit GEMMs are slower than fp32
// (Backend::low_precision_gemm_native false) the backend widens them to fp32 inside the GEMM —
// the same exact products, fp32 accumulation — so no fp32 copy of the weights exists anywhere.
class ComputeCast {
 public:
  static constexpr int kSlots = 3;  // GEMM inputs (0, 1), an input pinned for several GEMMs (2)
  ComputeCast(kernels::Backend& be, kernels::DType dtype) : be_(be), dtype_(dtype) {}
  kernels::DType dtype() const { return dtype_; }  // the storage type of compute copies and 16-bit activations
  bool active() const { return dtype_ != kernels::DType::kF32; }
  // n floats at x rounded to the compute type, in workspace `slot` (valid until the slot's next use).
  kernels::ConstView operator()(int slot, const float* x, int64_t n) {
    char* b = grow(slot, n);
    be_.convert({b, dtype_, {n}}, {kernels::f32(x), {n}});
    return {b, dtype_};
  }
  // Where a producer writes n GEMM inputs in the GEMMs' own 16-bit type (workspace `slot`, valid
  // until its next use): what operator() would have given for the producer's fp32 output,
  // without that fp32 array.
  kernels::View slot_view(int slot, int64_t n) {
    DS_CHECK(active(), "ComputeCast::slot_view: the GEMMs do not take 16-bit operands");
    return {grow(slot, n), dtype_};
  }
  // A weight as the GEMMs take it: its compute copy.
  kernels::ConstView weight(const uint16_t* lp) const { return {lp, dtype_}; }
  int64_t bytes() const {
    int64_t n = 0;
    for (const auto& b : buf_) n += b.bytes();
    return n;
  }

 private:
  char* grow(int slot, int64_t n) {
    kernels::DeviceBuffer& b = buf_[slot];
    const int64_t bytes = n * kernels::dtype_size(dtype_);
    if (b.bytes() < bytes) b = kernels::DeviceBuffer(be_, bytes);
    return static_cast<char*>(b.data());
  }
  kernels::Backend& be_;
  kernels::DType dtype_;
  kernels::DeviceBuffer buf_[kSlots];
};

// The expert-parallel backward buffers of a model instance's MoE layers: the owner side's
// received output gradients (dYr, in the order received; dYe, grouped by expert), which then
// hold the experts' input gradients on their way back (dXe in dYr's place once dYe is made,
// dXr in dYe's once the experts' backward has read it), and the experts' dM, dGU. One set per
// instance, which its MoE layers share — one layer runs its backward at a time — sized by the
// largest exchange (balanced routing at first, grown when a step receives more). A zero-bubble W
// queue copies what it keeps from them (they are volatile: DeepSeekModel::mark_workspace_volatile).
// The forward's rows that no backward reads live here too: the rows this rank sends to the
// experts' owners (Xs), and on the owner side the experts' outputs (Ye, in dYe's space) and
// those outputs in the order they go back (Yr, in dYr's) — a layer's forward, or its
// recomputation, ends before its backward begins.
struct EpBackwardBuffers {
  kernels::DeviceArray<float> dYr, dYe, dMe, dGUe, Xs;
  int64_t bytes() const { return dYr.bytes() + dYe.bytes() + dMe.bytes() + dGUe.bytes() + Xs.bytes(); }
};

struct LayerEnv {
  const config::ModelConfig* cfg = nullptr;
  kernels::Backend* be = nullptr;
  Collectives* coll = nullptr;
  ParamStore* params = nullptr;
  Scratch* scratch = nullptr;
  ActivationStore* acts = nullptr;  // where the layers' saved buffers live
  const float* ones = nullptr;  // at least as many 1.0f as tokens (bias gradients)
  const Progress* progress = nullptr;
  int tp_size = 1, tp_rank = 0;
  // Sequence parallelism in this layer: its input and output are this rank's token part only
  // (the MTP modules run without it).
  bool sp = false;
  // Sequence parallelism: three [N, H] buffers for the whole micro-batch, shared by the layers
  // (one runs at a time) — the gathered inputs and the partial outputs of the tensor-parallel
  // blocks — in `full` (the instances' shared workspace: its address is read at each use).
  kernels::DeviceArray<float>* full = nullptr;
  int64_t full_len = 0;  // N * H
  float* full_at(int i) const { return full ? full->data() + i * full_len : nullptr; }
  ComputeCast* cast = nullptr;  // null or fp32: every GEMM in fp32
  EpBackwardBuffers* ep_bwd = nullptr;  // the instance's (MoE layers under expert parallelism)
  void poll() const {
    if (progress) progress->poll();
  }
  int64_t heads() const { return cfg->num_attention_heads / tp_size; }  // local heads
};

// Weight and gradient pointers of one parameter, and its 16-bit compute copy. Under mixed
// precision a parameter whose ops read fp32 values (ParamStore::reads_fp32: norm weights, biases,
// the router) has `w` (the rounded values widened, a small side copy) and no `lp`; every other
// parameter has `lp` and no `w` (there is no fp32 copy of the compute weights). In fp32 only `w`.
struct WeightRef {
  float* w = nullptr;
  float* g = nullptr;
  const uint16_t* lp = nullptr;
  void bind(ParamStore& p, const std::string& name) {
    w = p.param(name);
    g = p.grad(name);
    lp = p.compute_param(name);
  }
  // Rows [first, ...) of a [rows, width] matrix.
  WeightRef rows(int64_t first, int64_t width) const {
    WeightRef r = *this;
    if (w) r.w += first * width;
    r.g += first * width;
    if (lp) r.lp += first * width;
    return r;
  }
  explicit operator bool() const { return g != nullptr; }
};

// The dtype a saved activation that only GEMMs read is kept in (docs/design.md §6.10): the
// compute type under bf16 / fp16 (the GEMMs read it as it is, backward included), else fp32.
inline kernels::DType gemm_input_dtype(const LayerEnv& env) {
  return env.cast && env.cast->active() ? env.cast->dtype() : kernels::DType::kF32;
}

// The ComputeCast slot of inputs rounded once for several GEMMs (Linear::pin).
inline constexpr int kPinned = 2;
// n floats at x rounded to the compute type once, into ComputeCast slot `slot`, for several
// 16-bit GEMMs that read them next (each GEMM then reads the view as it is); x itself where the
// GEMMs are fp32.
inline kernels::ConstView round_once(const LayerEnv& env, int slot, const float* x, int64_t n) {
  if (!env.cast || !env.cast->active()) return kernels::f32(x);
  return (*env.cast)(slot, x, n);
}
// Bias: y[r] += b;  db += sum_r dy[r]  (as ones^T dy).
inline void bias_forward(kernels::Backend& be, float* y, const float* b, int64_t rows, int64_t n) {
  be.add_strided({y, {rows, n}}, {b, {rows, n}, {0, 1}});
}
inline void bias_backward(kernels::Backend& be, float* db, const float* dy, const float* ones,
                          int64_t rows, int64_t n) {
  be.gemm({db, {1, n}}, {ones, {1, rows}}, {dy, {rows, n}}, false, false, 1.0f, 1.0f);
}

}  // namespace dstrain::model
