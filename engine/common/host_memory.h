// The process's allocator setting (docs/design.md §7.2): the one place dstrain changes glibc
// malloc's behaviour, called first thing in main() by every dstrain executable.
//
// glibc serves every allocation above 128 KiB (a threshold that grows to 32 MiB) with a fresh
// mmap, and hands the top of the heap back to the kernel as soon as 128 KiB of it are free. A
// trainer allocates and frees the same large buffers over and over — the GEMM libraries'
// packing buffers on every call, a checkpoint's tensors one at a time, collective buffers — so
// each round trip costs page faults on fresh zeroed pages, which are slow on virtual machines.
// With this setting allocations under 256 MiB come from the heap and up to 1 GiB of freed
// memory stays in the process for the next use. Measured on the project's 2-core VMs
// (docs/design.md §7.2): with glibc's defaults a `medium` checkpoint loads at 0.91 GB/s instead
// of 1.76 and saves at 1.24 GB/s instead of 1.47 (AMD Zen 4, 2026-11-30); on the Sapphire Rapids
// VM of an earlier session the defaults also cost 12% of a `small` training step (the GEMM
// library's packing buffers), which the Zen 4 VM did not show.
#pragma once

#include <cstdint>

namespace dstrain {

inline constexpr int kMmapThresholdBytes = 256 << 20;
inline constexpr int kTrimThresholdBytes = 1 << 30;

void tune_host_allocator();

// Bytes of memory this process may still use: the kernel's MemAvailable, or the cgroup's limit
// less its usage when that is smaller (a container). 0 when neither can be read.
int64_t host_memory_available();

// This process's peak resident memory so far (VmHWM), in bytes; 0 where /proc does not say.
int64_t peak_resident_bytes();

}  // namespace dstrain
