// The process's allocator setting (docs/design.md §7.2): the one place dstrain changes glibc
// malloc's behaviour, called first thing in main() by every dstrain executable.
//
// glibc serves every allocation above 128 KiB (a threshold that grows to 32 MiB) with a fresh
// mmap, and hands the top of the heap back to the kernel as soon as 128 KiB of it are free. A
// trainer allocates and frees the same large buffers over and over — the GEMM libraries'
// packing buffers on every call, a checkpoint's tensors one at a time, collective buffers — so
// each round trip costs page faults on fresh zeroed pages, which are slow on virtual machines.
// With this setting allocations under 256 MiB come from the heap and up to 1 GiB of freed
// memory stays in the process for the next use. Measured on the project's 2-core VM: the
// default settings cost 12% of a `small` training step (GEMM packing buffers) and halve the
// checkpoint load throughput (0.85 vs 1.55 GB/s); the README's performance section has the
// current figures.
#pragma once

namespace dstrain {

inline constexpr int kMmapThresholdBytes = 256 << 20;
inline constexpr int kTrimThresholdBytes = 1 << 30;

void tune_host_allocator();

}  // namespace dstrain
