#include "engine/common/host_memory.h"

#include <malloc.h>

#include <fstream>
#include <string>

namespace dstrain {

void tune_host_allocator() {
  mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
  mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes);
}

namespace {

// The first number in a file (cgroup files hold one; "max" reads as none).
bool read_number(const char* path, int64_t& out) {
  std::ifstream in(path);
  return static_cast<bool>(in >> out);
}

}  // namespace

int64_t host_memory_available() {
  int64_t available = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    int64_t kb = 0;
    meminfo >> kb;
    if (key == "MemAvailable:") available = kb * 1024;
    meminfo.ignore(256, '\n');
  }
  int64_t limit = 0, usage = 0;
  if ((read_number("/sys/fs/cgroup/memory.max", limit) && read_number("/sys/fs/cgroup/memory.current", usage)) ||
      (read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes", limit) &&
       read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes", usage))) {
    const int64_t room = limit - usage;
    if (room > 0 && (available == 0 || room < available)) available = room;
  }
  return available;
}

int64_t peak_resident_bytes() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // "VmHWM:   123 kB"
  return 0;
}

}  // namespace dstrain
