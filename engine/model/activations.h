// Where a model instance keeps the activations its backward pass reads (docs/design.md §6.7).
//
// Every decoder layer takes its saved buffers from one ActivationStore at construction. A layer
// declares each buffer either always kept or in the selective set (memory-heavy and cheap to
// recompute: normed copies, the attention core's output, SwiGLU and expert activations, the
// dispatched rows). Under the layer's recomputation mode a buffer is
//   kept       — in the store's private region, one per layer, alive from forward to backward;
//   recomputed — in the shared region (a RecomputeArena), which every recomputing layer reuses
//                — of the instance, or of every instance of a pipeline rank when the runtime
//                hands them one arena — sized for the largest layer, rewritten by the layer's
//                backward right before it reads it, with the same kernels on the same inputs
//                (bitwise equal).
// kFull recomputes every buffer of the layer (only its input, the model's hidden state, is
// kept); kSelective those of the selective set; kNone none.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/common/error.h"
#include "engine/config/train_config.h"

namespace dstrain::model {

enum class Recompute : uint8_t { kNone, kSelective, kFull };
inline Recompute recompute_mode(const config::ActivationCheckpointingConfig& c) {
  if (!c.enabled) return Recompute::kNone;
  return c.granularity == config::CheckpointGranularity::kFull ? Recompute::kFull : Recompute::kSelective;
}

class ActivationStore;
class WeightGradDeferral;

// The recomputed buffers' home: one region and the dynamic slots, and which layer's values they
// hold now. Shared by the stores of the model instances one rank runs one at a time; it grows
// when a store needs more (ActBuf resolves its address on each use).
struct RecomputeArena {
  kernels::DeviceBuffer region;  // from the backend (docs/design.md §6.1)
  float* data() const { return region.as<float>(); }
  std::vector<std::unique_ptr<kernels::DeviceArray<float>>> slots;
  const void* holder = nullptr;  // the layer whose forward or recomputation wrote them last
  int64_t bytes() const;
};

// A fixed-size buffer of n elements of one dtype placed by an ActivationStore; its address is
// valid once the store is finalised (the layers only take buffers while they are built, and
// touch them after). fp32 buffers are read through data(); a 16-bit one — a GEMM-only input
// kept in the compute type under bf16 / fp16 (docs/design.md §6.10) — through view().
class ActBuf {
 public:
  float* data() const;  // fp32 buffers only
  kernels::View view() const { return {raw(), dtype_}; }
  void* raw() const;
  int64_t size() const { return n_; }
  kernels::DType dtype() const { return dtype_; }
  int64_t bytes() const { return n_ * kernels::dtype_size(dtype_); }
  bool recomputed() const { return shared_; }

 private:
  friend class ActivationStore;
  const ActivationStore* store_ = nullptr;
  bool shared_ = false;
  kernels::DType dtype_ = kernels::DType::kF32;
  int64_t off_ = 0, n_ = 0;  // offset in bytes
};

class ActivationStore {
 public:
  // `arena`: where the recomputed buffers live (null: a new one, this store's alone).
  explicit ActivationStore(std::shared_ptr<RecomputeArena> arena = nullptr);
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // The buffers taken from now on belong to a new layer with this recomputation mode.
  void begin_layer(Recompute mode);
  Recompute mode() const { return mode_; }
  // n elements of `dtype`; `selective`: part of the selective set (recomputed under kSelective).
  ActBuf take(int64_t n, bool selective = false, kernels::DType dtype = kernels::DType::kF32);
  // A buffer whose size is only known at run time (the expert-parallel receive side), placed
  // by the same rule: the recomputing layers share one array per slot.
  kernels::DeviceArray<float>* take_dynamic(bool selective = false);
  // Allocates both regions through the backend (zero-filled); no take after this.
  void finalize(kernels::Backend& be);

  // Bytes held: the kept buffers (private region and kept dynamic vectors) and the arena's
  // (region and slots, at the vectors' current capacity; shared with other stores maybe).
  int64_t kept_bytes() const;
  int64_t recomputed_bytes() const { return arena_->bytes(); }
  const std::shared_ptr<RecomputeArena>& arena() const { return arena_; }
  // Registers the recomputed buffers as overwritten by later kernels of a backward pass.
  void mark_volatile(WeightGradDeferral& d) const;
  // The layer whose values the recomputed buffers hold now (its forward or its recomputation
  // wrote them last): that layer's backward need not recompute.
  void set_holder(const void* layer) { arena_->holder = layer; }
  const void* holder() const { return arena_->holder; }

 private:
  friend class ActBuf;
  bool recomputes(bool selective) const {
    return mode_ == Recompute::kFull || (mode_ == Recompute::kSelective && selective);
  }
  Recompute mode_ = Recompute::kNone;
  bool final_ = false;
  int64_t kept_used_ = 0, shared_used_ = 0, shared_max_ = 0;  // bytes
  size_t dyn_slot_ = 0;
  kernels::DeviceBuffer kept_;
  std::vector<std::unique_ptr<kernels::DeviceArray<float>>> kept_dyn_;
  std::shared_ptr<RecomputeArena> arena_;
};

inline void* ActBuf::raw() const {
  DS_CHECK(store_ == nullptr || store_->final_, "activation buffer used before its store was finalised");
  if (!store_) return nullptr;
  return static_cast<char*>(shared_ ? store_->arena_->region.data() : store_->kept_.data()) + off_;
}

inline float* ActBuf::data() const {
  DS_CHECK(dtype_ == kernels::DType::kF32, "a 16-bit activation buffer read as fp32");
  return static_cast<float*>(raw());
}

}  // namespace dstrain::model
