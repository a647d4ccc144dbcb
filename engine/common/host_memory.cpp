#include "engine/common/host_memory.h"

#include <malloc.h>

namespace dstrain {

void tune_host_allocator() {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
}

}  // namespace dstrain
