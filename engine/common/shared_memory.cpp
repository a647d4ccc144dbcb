#include "engine/common/shared_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

namespace dstrain {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<const char*, SharedRegion>& registry() {
  static std::map<const char*, SharedRegion> r;
  return r;
}

}  // namespace

void* shared_alloc(size_t bytes) {
  if (bytes < kSharedMin) {
    void* p = std::malloc(bytes ? bytes : 1);
    if (!p) throw std::bad_alloc();
    return p;
  }
  const int fd = memfd_create("dstrain-flat-buffer", MFD_CLOEXEC);
  if (fd < 0) throw std::bad_alloc();
  if (ftruncate(fd, off_t(bytes)) != 0) {
    close(fd);
    throw std::bad_alloc();
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    throw std::bad_alloc();
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[static_cast<const char*>(p)] = {p, bytes, fd};
  return p;
}

void shared_free(void* p, size_t bytes) noexcept {
  if (!p) return;
  if (bytes < kSharedMin) {
    std::free(p);
    return;
  }
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(static_cast<const char*>(p));
    if (it != registry().end()) fd = it->second.fd, registry().erase(it);
  }
  munmap(p, bytes);
  if (fd >= 0) close(fd);
}

namespace {
size_t page_size() {
  static const size_t page = size_t(sysconf(_SC_PAGESIZE));
  return page;
}
}  // namespace

void release_to_zero(void* p, size_t bytes) noexcept {
  if (!p || bytes == 0) return;
  char* c = static_cast<char*>(p);
  const size_t page = page_size();
  char* first = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(c) + page - 1) / page * page);
  char* last = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(c + bytes)) / page * page);
  if (first >= last) {  // no whole page inside
    std::memset(c, 0, bytes);
    return;
  }
  std::memset(c, 0, size_t(first - c));
  std::memset(last, 0, size_t(c + bytes - last));
  // Shared memory (memfd): MADV_REMOVE frees the backing pages for every mapping; private memory:
  // MADV_DONTNEED leaves zero-fill-on-demand pages. Where neither applies, zeros are written.
  const bool shared = find_shared_region(first, size_t(last - first)).has_value();
  if (madvise(first, size_t(last - first), shared ? MADV_REMOVE : MADV_DONTNEED) != 0)
    std::memset(first, 0, size_t(last - first));
}

int64_t resident_bytes(const void* p, size_t bytes) {
  if (!p || bytes == 0) return 0;
  const size_t page = page_size();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  const size_t pages = (end - a + page - 1) / page;
  std::vector<unsigned char> in(pages);
  if (mincore(reinterpret_cast<void*>(a), pages * page, in.data()) != 0) return -1;
  int64_t n = 0;
  for (unsigned char v : in) n += v & 1;
  return n * int64_t(page);
}

std::optional<SharedRegion> find_shared_region(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().upper_bound(c);
  if (it == registry().begin()) return std::nullopt;
  --it;
  const SharedRegion& r = it->second;
  if (c + bytes <= static_cast<const char*>(r.base) + r.bytes) return r;
  return std::nullopt;
}

}  // namespace dstrain
