#include "engine/model/activations.h"

#include "engine/model/layer_env.h"

namespace dstrain::model {

namespace {
constexpr int64_t kAlign = 64;  // bytes: every buffer starts 64-byte aligned within its region
int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
}  // namespace

int64_t RecomputeArena::bytes() const {
  int64_t bytes = region.bytes();
  for (const auto& v : slots) bytes += v->bytes();
  return bytes;
}

ActivationStore::ActivationStore(std::shared_ptr<RecomputeArena> arena)
    : arena_(arena ? std::move(arena) : std::make_shared<RecomputeArena>()) {}

void ActivationStore::begin_layer(Recompute mode) {
  DS_CHECK(!final_, "activation store already finalised");
  mode_ = mode;
  shared_used_ = 0;
  dyn_slot_ = 0;
}

ActBuf ActivationStore::take(int64_t n, bool selective, kernels::DType dtype) {
  DS_CHECK(!final_ && n >= 0, "activation store: take({}) after finalise", n);
  ActBuf b;
  b.store_ = this;
  b.n_ = n;
  b.dtype_ = dtype;
  b.shared_ = recomputes(selective);
  if (b.shared_) {
    b.off_ = shared_used_;
    shared_used_ += aligned(b.bytes());
    shared_max_ = std::max(shared_max_, shared_used_);
  } else {
    b.off_ = kept_used_;
    kept_used_ += aligned(b.bytes());
  }
  return b;
}

kernels::DeviceArray<float>* ActivationStore::take_dynamic(bool selective) {
  DS_CHECK(!final_, "activation store: take_dynamic after finalise");
  if (!recomputes(selective)) return kept_dyn_.emplace_back(std::make_unique<kernels::DeviceArray<float>>()).get();
  // The recomputing layers share by slot: the k-th dynamic buffer of each such layer.
  auto& slots = arena_->slots;
  if (dyn_slot_ == slots.size()) slots.push_back(std::make_unique<kernels::DeviceArray<float>>());
  return slots[dyn_slot_++].get();
}

void ActivationStore::finalize(kernels::Backend& be) {
  DS_CHECK(!final_, "activation store finalised twice");
  // Sizes are multiples of 64 bytes: zero-filled as floats (zero bits are zero in every dtype).
  kept_ = kernels::DeviceBuffer(be, kept_used_);
  be.fill({kept_.as<float>(), {kept_used_ / int64_t(sizeof(float))}}, 0.0f);
  if (arena_->region.bytes() < shared_max_) {  // grows: what it held is gone
    arena_->region = kernels::DeviceBuffer(be, shared_max_);
    be.fill({arena_->data(), {shared_max_ / int64_t(sizeof(float))}}, 0.0f);
    arena_->holder = nullptr;
  }
  final_ = true;
}

int64_t ActivationStore::kept_bytes() const {
  int64_t bytes = kept_.bytes();
  for (const auto& v : kept_dyn_) bytes += v->bytes();
  return bytes;
}

void ActivationStore::mark_volatile(WeightGradDeferral& d) const {
  d.add_volatile(&arena_->region);  // by buffer: a later instance may grow (replace) it
  for (const auto& v : arena_->slots) d.add_volatile(v.get());
}

}  // namespace dstrain::model
