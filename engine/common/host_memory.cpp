#include "engine/common/host_memory.h"

#include <malloc.h>

namespace dstrain {

void tune_host_allocator() {
  mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
  mallopt(M_TRIM_THRESHOLD, kTrimThresholdBytes);
}

}  // namespace dstrain
