// A backend whose memory the host cannot address (docs/design.md §6.11): another backend behind
// pointers moved into the non-canonical half of the x86-64 address space. Every pointer it hands
// out has bit 62 set, so a host load or store through one faults at once (SIGSEGV), exactly
// where code would read GPU memory from the host; every op checks that the pointers it gets
// carry the bit (else std::invalid_argument: a host pointer passed as device memory), clears
// it, and runs on the inner backend — Backend's wrappers do that through operand() and
// target_ (docs/design.md §6.1, "One seam per operation"), so this class holds only memory. Host data crosses only through copy_to_host /
// copy_from_host. The engine runs on it when DSTRAIN_DEVICE_MEMORY_CHECK=1, which is how tests
// without a GPU prove the engine is device-clean for the CUDA backend.
//
// Its memory behaves as the CUDA pool's does where the CPU's would hide a fault: freed blocks are
// cached and handed out again (the same block to the next request of its size class), every block
// handed out is poisoned — all bytes 0xFF, a NaN in fp32, bf16 and fp16, -1 as an int32 — so
// a read of memory nothing wrote shows as NaN or a refused index instead of the zeros of fresh
// pages; and a freed block that a device communicator's operation still uses (record_use) is
// not handed out until that operation has finished (docs/design.md §6.11).
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"

namespace dstrain::kernels {

namespace {

constexpr uintptr_t kDeviceBit = uintptr_t(1) << 62;

class DeviceCheckBackend final : public Backend {
 public:
  explicit DeviceCheckBackend(std::unique_ptr<Backend> inner) : in_(std::move(inner)) {
    // Every op runs on the inner backend (Backend's wrappers call target_), with the pointers
    // operand() below gave back; this class keeps only what is device-specific: its memory.
    target_ = in_.get();
    name_ = in_->name() + " behind checked device memory";
    host_addressable_ = false;
  }
  ~DeviceCheckBackend() override {
    for (auto& [size, b] : free_) in_->deallocate(b.p);
    for (auto& [a, b] : live_) in_->deallocate(b.p);
  }

  bool is_device_memory(const void* p) const override { return (reinterpret_cast<uintptr_t>(p) & kDeviceBit) != 0; }
  void* host_mapping(const void* p) const override {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return a & kDeviceBit ? reinterpret_cast<void*>(a & ~kDeviceBit) : nullptr;
  }

  // The CUDA pool's policy (kernels/cuda/cuda_backend.cu): the smallest cached block of at least
  // the size and at most twice it whose recorded uses have finished, else a new one; poisoned.
  void* allocate(int64_t bytes) override {
    const int64_t size = (std::max<int64_t>(bytes, 1) + 63) / 64 * 64;
    std::lock_guard<std::mutex> lock(mu_);
    Block got{};
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size; ++it) {
      if (!settled(it->second)) continue;
      got = it->second;
      cached_ -= got.size;
      free_.erase(it);
      break;
    }
    if (!got.p) got = Block{in_->allocate(size), size, {}};
    std::memset(got.p, 0xFF, size_t(got.size));
    live_[reinterpret_cast<uintptr_t>(got.p)] = got;
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(got.p) | kDeviceBit);
  }
  void deallocate(void* p) override {
    if (!p) return;
    void* inner = h(p, "deallocate");
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(inner));
    if (it == live_.end()) throw std::invalid_argument("deallocate of a pointer this backend did not hand out");
    Block b = std::move(it->second);
    live_.erase(it);
    cached_ += b.size;
    free_.emplace(b.size, std::move(b));
    // Bounded: beyond kMaxCached, blocks nothing uses any more go back to the inner backend.
    for (auto f = free_.begin(); cached_ > kMaxCached && f != free_.end();) {
      if (!settled(f->second)) {
        ++f;
        continue;
      }
      cached_ -= f->second.size;
      in_->deallocate(f->second.p);
      f = free_.erase(f);
    }
  }
  void record_use(const void* p, std::shared_ptr<StreamUse> use) override {
    const auto a = reinterpret_cast<uintptr_t>(p);
    if (!(a & kDeviceBit) || !use) return;
    const uintptr_t inner = a & ~kDeviceBit;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.upper_bound(inner);
    if (it == live_.begin()) return;
    --it;
    if (inner < it->first + uintptr_t(it->second.size)) it->second.uses.push_back(std::move(use));
  }
 protected:
  // The inner backend's pointer behind a device pointer; a pointer without the device bit is a
  // host pointer passed where device memory belongs.
  const void* operand(const char* op, const void* p) const override {
    const auto u = reinterpret_cast<uintptr_t>(p);
    if (!(u & kDeviceBit))
      throw std::invalid_argument(std::string(op) + ": a host pointer (or null) where device memory belongs");
    return reinterpret_cast<const void*>(u & ~kDeviceBit);
  }

 private:
  template <class T>
  T* h(T* p, const char* op) const {
    return static_cast<T*>(const_cast<void*>(operand(op, p)));
  }

  struct Block {
    void* p = nullptr;  // the inner backend's address
    int64_t size = 0;
    std::vector<std::shared_ptr<StreamUse>> uses;  // operations elsewhere that touch it
  };
  // Drops the finished uses; true when none is left (the block may be handed out).
  static bool settled(Block& b) {
    std::erase_if(b.uses, [](const std::shared_ptr<StreamUse>& u) { return u->finished(); });
    return b.uses.empty();
  }
  static constexpr int64_t kMaxCached = int64_t(256) << 20;

  std::unique_ptr<Backend> in_;
  std::mutex mu_;
  std::map<uintptr_t, Block> live_;      // handed out, by inner address
  std::multimap<int64_t, Block> free_;   // cached, by size
  int64_t cached_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_device_check_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<DeviceCheckBackend>(std::move(inner));
}

}  // namespace dstrain::kernels
