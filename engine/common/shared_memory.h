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
// Makes [p, p + bytes) read as zeros and gives the whole pages in it back to the system: a hole
// punched in shared memory (every process that maps it then reads zeros there and holds nothing),
// private pages dropped; the partial pages at the ends are zero-filled. Memory that is written
// again is faulted in afresh, zeroed. (ZeRO-2's gradient buffer: the parts a rank does not own,
// engine/parallel/grad_sync.h.)
void release_to_zero(void* p, size_t bytes) noexcept;
// Bytes of the pages of [p, p + bytes) that hold memory now (mincore; a partial page counts
// whole); -1 where the system cannot say.
int64_t resident_bytes(const void* p, size_t bytes);
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
