#include "engine/model/activations.h"

#include "engine/model/layer_env.h"

namespace dstrain::model {

namespace {
constexpr int64_t kAlign = 16;  // floats: every buffer starts 64-byte aligned within its region
int64_t aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

int64_t RecomputeArena::bytes() const {
  int64_t floats = int64_t(region.capacity());
  for (const auto& v : slots) floats += int64_t(v->capacity());
  return floats * int64_t(sizeof(float));
}

ActivationStore::ActivationStore(std::shared_ptr<RecomputeArena> arena)
    : arena_(arena ? std::move(arena) : std::make_shared<RecomputeArena>()) {}

void ActivationStore::begin_layer(Recompute mode) {
  DS_CHECK(!final_, "activation store already finalised");
  mode_ = mode;
  shared_used_ = 0;
  dyn_slot_ = 0;
}

ActBuf ActivationStore::take(int64_t n, bool selective) {
  DS_CHECK(!final_ && n >= 0, "activation store: take({}) after finalise", n);
  ActBuf b;
  b.store_ = this;
  b.n_ = n;
  b.shared_ = recomputes(selective);
  if (b.shared_) {
    b.off_ = shared_used_;
    shared_used_ += aligned(n);
    shared_max_ = std::max(shared_max_, shared_used_);
  } else {
    b.off_ = kept_used_;
    kept_used_ += aligned(n);
  }
  return b;
}

std::vector<float>* ActivationStore::take_dynamic(bool selective) {
  DS_CHECK(!final_, "activation store: take_dynamic after finalise");
  if (!recomputes(selective)) return kept_dyn_.emplace_back(std::make_unique<std::vector<float>>()).get();
  // The recomputing layers share by slot: the k-th dynamic buffer of each such layer.
  auto& slots = arena_->slots;
  if (dyn_slot_ == slots.size()) slots.push_back(std::make_unique<std::vector<float>>());
  return slots[dyn_slot_++].get();
}

void ActivationStore::finalize() {
  DS_CHECK(!final_, "activation store finalised twice");
  kept_.assign(size_t(kept_used_), 0.0f);
  if (int64_t(arena_->region.size()) < shared_max_) {  // grows: what it held is gone
    arena_->region.assign(size_t(shared_max_), 0.0f);
    arena_->holder = nullptr;
  }
  final_ = true;
}

int64_t ActivationStore::kept_bytes() const {
  int64_t floats = int64_t(kept_.size());
  for (const auto& v : kept_dyn_) floats += int64_t(v->capacity());
  return floats * int64_t(sizeof(float));
}

void ActivationStore::mark_volatile(WeightGradDeferral& d) const {
  d.add_volatile(&arena_->region);  // by vector: a later instance may grow it
  for (const auto& v : arena_->slots) d.add_volatile(v.get());
}

}  // namespace dstrain::model
