// The CUDA backend (kernels/cuda/, docs/design.md §6.11): the Backend of backend.h on one GPU —
// device memory from a caching pool, every op ordered on one compute stream, GEMMs through
// cuBLASLt, the other ops as kernels whose per-element math is kernels/cuda/device_math.h.
// It lives in a plugin, libdstrain_cuda.so, which these functions load on first use
// (kernels/cuda/cuda_loader.cpp): a process that never asks for a GPU never maps the CUDA
// libraries (cuBLASLt alone costs about 200 MB of memory to load), and a binary built with the
// backend still starts where the CUDA runtime is missing. Built with the backend only
// (DSTRAIN_HAVE_CUDA, CMake option DSTRAIN_CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dstrain/kernels/backend.h"

namespace dstrain::kernels {

// What the CUDA runtime reports; count 0 (and `error` saying why) where there is no usable GPU
// or driver, or the plugin cannot be loaded — the call itself never throws.
struct CudaDeviceInfo {
  int count = 0;             // visible devices
  std::string error;         // why count is 0
  std::string name;          // of `device`
  int64_t memory_bytes = 0;
  int cc_major = 0, cc_minor = 0, multiprocessors = 0;
  int driver_version = 0, runtime_version = 0;  // 13000 = 13.0
  int64_t cublaslt_version = 0;
};
CudaDeviceInfo cuda_device_info(int device = 0);

// Throws std::runtime_error naming the CUDA error where the device cannot be used.
std::unique_ptr<Backend> make_cuda_backend(int device = 0);

// The caching pool of a CUDA backend: cudaMalloc calls so far (a step that reuses memory makes
// none), bytes handed out now, their peak, bytes cached for reuse.
struct CudaPoolStats {
  int64_t device_mallocs = 0, bytes_in_use = 0, peak_bytes = 0, cached_bytes = 0;
};
// Throws std::invalid_argument when `be` is not a CUDA backend.
CudaPoolStats cuda_pool_stats(Backend& be);

// The plugin's NVTX range functions (nvtxRangePushA / nvtxRangePop: Nsight Systems shows the
// ranges; without a profiler attached they cost next to nothing), for the step trace's range
// hooks (engine/common/trace.h); null where the plugin is not loaded.
struct CudaRangeHooks {
  void (*push)(const char*) = nullptr;
  void (*pop)() = nullptr;
};
CudaRangeHooks cuda_range_hooks();

// The plugin's interface version: the loader refuses a libdstrain_cuda.so of another.
constexpr int kCudaPluginAbi = 3;

}  // namespace dstrain::kernels
