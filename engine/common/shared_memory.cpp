#include "engine/common/shared_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
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
