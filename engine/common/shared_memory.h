// Host memory that other processes on the machine can map. The flat parameter and gradient
// buffers live in it so that data-parallel ranks on one host reduce and gather them by reading
// each other's buffers directly (Communicator::register_peer_memory), the way NCCL uses
// registered buffers within a node, instead of copying every byte through MPI messages.
//
// Allocations of at least 1 MiB are mappings of their own memfd, listed in a process-wide
// registry (find_shared_region) so that the communicator can hand a peer the descriptor to map;
// smaller ones come from malloc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace dstrain {

// Allocations from this size up are shared memory (below it: plain heap memory).
inline constexpr size_t kSharedMin = size_t(1) << 20;

struct SharedRegion {
  void* base = nullptr;
  size_t bytes = 0;
  int fd = -1;  // this process's memfd; another process maps /proc/<pid>/fd/<fd>
};

void* shared_alloc(size_t bytes);
void shared_free(void* p, size_t bytes) noexcept;
// The shared region that contains [p, p + bytes), if any.
std::optional<SharedRegion> find_shared_region(const void* p, size_t bytes);

template <class T>
struct SharedAllocator {
  using value_type = T;
  SharedAllocator() = default;
  template <class U>
  SharedAllocator(const SharedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(shared_alloc(n * sizeof(T))); }
  void deallocate(T* p, size_t n) noexcept { shared_free(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const SharedAllocator<U>&) const { return true; }
};

template <class T>
using SharedVector = std::vector<T, SharedAllocator<T>>;

}  // namespace dstrain
