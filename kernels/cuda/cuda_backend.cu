// The CUDA backend (docs/design.md §6.11). One compute stream per backend: every op is a kernel
// launch or a cuBLASLt call ordered on it, so the host never waits except in copy_to_host /
// copy_from_host / synchronize. Device memory comes from a caching pool (a block freed is kept
// for the next request of its size class; cudaMalloc only on a miss), so a training step that
// repeats the previous one's allocations makes no cudaMalloc. The per-element and per-row math
// is kernels/cuda/device_math.h, shared with the host tests.
//
// Deterministic by construction: no atomics. Reductions over rows (RMSNorm's weight gradient,
// the embedding's table gradient) give each output column to one thread, which walks the rows
// in order, so the same inputs give the same bits on every run.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cub/device/device_radix_sort.cuh>
#include <dlfcn.h>
#include <mma.h>
#include <nvtx3/nvToolsExt.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/cuda.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/device_math.h"

#ifndef DSTRAIN_CUDNN_PLUGIN_NAME  // (set by kernels/CMakeLists.txt where the plugin is built)
#define DSTRAIN_CUDNN_PLUGIN_NAME "libdstrain_cudnn.so"
#endif

namespace dstrain::kernels {

namespace {

void cuda_ok(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                             ") in " + what + " at " + file + ":" + std::to_string(line));
}
void lt_ok(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("cuBLASLt status " + std::to_string(int(s)) + " in " + what + " at " + file + ":" +
                             std::to_string(line));
}
#define DS_CUDA(x) cuda_ok((x), #x, __FILE__, __LINE__)
#define DS_LT(x) lt_ok((x), #x, __FILE__, __LINE__)
// A launch's configuration errors surface at the next call; check right after it.
#define DS_LAUNCHED() DS_CUDA(cudaGetLastError())

// ---- The cuDNN attention plugin (DSTRAIN_CUDA_ATTENTION=cudnn) -------------------------------

// libdstrain_cudnn.so (kernels/cuda/cudnn_attention.cpp), loaded on first use as this plugin is
// by its loader: from $DSTRAIN_CUDNN_PLUGIN, else beside this library (bin/../lib in the build
// and the GPU bundle), else beside the executable's bin/../lib, else the loader's search path.
// Only it maps libcudnn; where it does not load, `error` keeps why (one line).
struct CudnnPlugin {
  void* handle = nullptr;
  std::string error;
  decltype(&dstrain_cudnn_open) open = nullptr;
  decltype(&dstrain_cudnn_close) close = nullptr;
  decltype(&dstrain_cudnn_attention_prepare) prepare = nullptr;
  decltype(&dstrain_cudnn_attention_run) run = nullptr;
};

std::string directory_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

const CudnnPlugin& cudnn_plugin() {
  static CudnnPlugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> paths;
    if (const char* env = std::getenv("DSTRAIN_CUDNN_PLUGIN"); env && *env) paths.push_back(env);
    Dl_info self{};
    if (dladdr(&p, &self) && self.dli_fname && *self.dli_fname)  // (p: an object of this library)
      paths.push_back(directory_of(self.dli_fname) + "/" + DSTRAIN_CUDNN_PLUGIN_NAME);
    char exe[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) paths.push_back(directory_of(directory_of(std::string(exe, size_t(n)))) + "/lib/" +
                               DSTRAIN_CUDNN_PLUGIN_NAME);
    paths.push_back(DSTRAIN_CUDNN_PLUGIN_NAME);
    std::string tried;
    for (size_t i = 0; i < paths.size() && !p.handle; ++i) {
      if (std::find(paths.begin(), paths.begin() + long(i), paths[i]) != paths.begin() + long(i)) continue;
      p.handle = dlopen(paths[i].c_str(), RTLD_NOW | RTLD_LOCAL);
      if (p.handle) break;
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + std::string(why ? why : paths[i].c_str());
    }
    if (!p.handle) {
      p.error = "cuDNN attention plugin unavailable (" + tried + ")";
      return;
    }
    const auto abi = reinterpret_cast<int (*)()>(dlsym(p.handle, "dstrain_cudnn_plugin_abi"));
    p.open = reinterpret_cast<decltype(p.open)>(dlsym(p.handle, "dstrain_cudnn_open"));
    p.close = reinterpret_cast<decltype(p.close)>(dlsym(p.handle, "dstrain_cudnn_close"));
    p.prepare = reinterpret_cast<decltype(p.prepare)>(dlsym(p.handle, "dstrain_cudnn_attention_prepare"));
    p.run = reinterpret_cast<decltype(p.run)>(dlsym(p.handle, "dstrain_cudnn_attention_run"));
    if (!abi || !p.open || !p.close || !p.prepare || !p.run || abi() != kCudnnPluginAbi) {
      p.error = std::string("cuDNN attention plugin unavailable (interface ") +
                (abi ? std::to_string(abi()) : "missing") + ", expected " + std::to_string(kCudnnPluginAbi) + ")";
      p.open = nullptr, p.close = nullptr, p.prepare = nullptr, p.run = nullptr;
    }
  });
  return p;
}

// DSTRAIN_CUDA_ATTENTION, read per call (so a check can run every path): the tensor-core tiles
// where they apply (unset or `tiled`), the rows kernels (`rows`), or cuDNN's fused attention
// for bf16 / fp16 inputs (`cudnn`; fp32 inputs run the rows kernels whatever the choice).
enum class AttentionChoice { kTiled, kRows, kCudnn };
AttentionChoice attention_choice() {
  const char* choice = std::getenv("DSTRAIN_CUDA_ATTENTION");
  if (!choice || std::string(choice) == "tiled") return AttentionChoice::kTiled;
  if (std::string(choice) == "rows") return AttentionChoice::kRows;
  if (std::string(choice) == "cudnn") return AttentionChoice::kCudnn;
  throw std::invalid_argument(std::string("DSTRAIN_CUDA_ATTENTION=") + choice +
                              ": valid: tiled, rows, cudnn (cudnn: cuDNN's fused attention for bf16 / fp16 inputs; "
                              "fp32 inputs run the rows kernels whatever the choice)");
}

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 256;   // attention's dqk and dv (device_math.h MAXD)
constexpr int kMaxExperts = 256;   // the router's bit masks (device_math.h MAXE)
constexpr int kMaxGroups = 64;     // its group scores (MAXG)

int blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(std::min<int64_t>(std::max<int64_t>(b, 1), 1 << 20));
}

// ---- Reductions --------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// The functor the warp-cooperative rows of device_math.h reduce with.
struct WarpSum {
  __host__ __device__ float operator()(float x) const {
#if defined(__CUDA_ARCH__)
    return warp_sum(x);
#else
    return x;
#endif
  }
};

// Every thread of the block gets the same total (summed in the same order: deterministic).
template <bool kMax>
__device__ float block_reduce(float x) {
  __shared__ float part[kThreads / 32];
  x = kMax ? warp_max(x) : warp_sum(x);
  __syncthreads();  // the previous call's readers are done with `part`
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = x;
  __syncthreads();
  float t = part[0];
  for (int i = 1; i < kThreads / 32; ++i) t = kMax ? fmaxf(t, part[i]) : t + part[i];
  return t;
}

// ---- Element-wise and conversions --------------------------------------------------------------

#define GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__global__ void fill_kernel(float* y, float v, int64_t n) {
  GRID_STRIDE(i, n) y[i] = v;
}
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  GRID_STRIDE(i, n) y[i] += x[i];
}
__global__ void scale_kernel(float* y, float beta, int64_t n) {
  GRID_STRIDE(i, n) y[i] = beta == 0.0f ? 0.0f : beta * y[i];
}
template <bool kAdd>
__global__ void strided_kernel(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t cols) {
  GRID_STRIDE(i, rows * cols) {
    const int64_t r = i / cols, c = i % cols;
    if (kAdd) dst[r * ds + c] += src[r * ss + c];
    else dst[r * ds + c] = src[r * ss + c];
  }
}
// KIND 0 / 1 / 2: dst in fp32 / bf16 / fp16 (rounded as convert() rounds).
template <int KIND>
__global__ void copy_strided_kernel(dev::Storage<KIND>* dst, int64_t ds, const float* src, int64_t ss, int64_t rows,
                                    int64_t cols) {
  GRID_STRIDE(i, rows * cols) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ds + c] = dev::store_as<KIND>(src[r * ss + c]);
  }
}
template <int KIND>
__global__ void to_lowp_kernel(uint16_t* y, const float* x, int64_t n) {
  GRID_STRIDE(i, n) y[i] = dev::store_as<KIND>(x[i]);
}
template <int KIND>
__global__ void from_lowp_kernel(float* y, const uint16_t* x, int64_t n) {
  GRID_STRIDE(i, n) y[i] = dev::load<KIND>(x, i);
}
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n, dev::AdamWConsts k) {
  GRID_STRIDE(i, n) dev::adamw_element(param + i, grad[i], m + i, v + i, k);
}
// Mixed precision's step in one pass: the master weight updated, rounded into the compute copy,
// and (widened != nullptr) the rounded value widened into the fp32 view.
template <int KIND>
__global__ void adamw_round_kernel(float* param, const float* grad, float* m, float* v, int64_t n, dev::AdamWConsts k,
                                   uint16_t* half, float* widened) {
  GRID_STRIDE(i, n) {
    dev::adamw_element(param + i, grad[i], m + i, v + i, k);
    half[i] = dev::store_as<KIND>(param[i]);
    if (widened) widened[i] = dev::load<KIND>(half, i);
  }
}

// ---- RMSNorm -----------------------------------------------------------------------------------

template <int KIND>  // y in fp32 / bf16 / fp16 (rounded as convert() rounds)
__global__ void rmsnorm_forward_kernel(dev::Storage<KIND>* y, float* rstd, const float* x, const float* w, int64_t C,
                                       float eps) {
  const int64_t r = blockIdx.x;
  const float* xr = x + r * C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += xr[c] * xr[c];
  ss = block_reduce<false>(ss);
  const float rs = 1.0f / sqrtf(ss / float(C) + eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) y[r * C + c] = dev::store_as<KIND>(w[c] * (xr[c] * rs));
}
__global__ void rmsnorm_backward_dx_kernel(float* dx, const float* dy, const float* x, const float* w,
                                           const float* rstd, int64_t C) {
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  const float *xr = x + r * C, *dyr = dy + r * C;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += dyr[c] * w[c] * xr[c] * rs;
  dot = block_reduce<false>(dot) / float(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dx[r * C + c] = rs * (dyr[c] * w[c] - xr[c] * rs * dot);
}
// dw in two passes, in a fixed order (deterministic, independent of the launch): blocks of
// kDwCols columns x kDwLanes row lanes over chunks of kDwChunk rows write one partial per chunk
// and column; then each column adds its chunks' partials in order. (A thread per column walking
// every row, as before, left all but a few dozen warps of the GPU idle: 8 ms a call at 16k rows.)
constexpr int kDwCols = 32, kDwLanes = 8;
constexpr int64_t kDwChunk = 256;
__global__ void rmsnorm_dw_partial_kernel(float* partial, const float* dy, const float* x, const float* rstd,
                                          int64_t rows, int64_t C) {
  __shared__ float lane_sum[kDwLanes][kDwCols];
  const int64_t c = int64_t(blockIdx.x) * kDwCols + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kDwChunk, r1 = r0 + kDwChunk < rows ? r0 + kDwChunk : rows;
  float acc = 0;
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kDwLanes) acc += dy[r * C + c] * x[r * C + c] * rstd[r];
  lane_sum[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float sum = 0;
    for (int l = 0; l < kDwLanes; ++l) sum += lane_sum[l][threadIdx.x];
    partial[int64_t(blockIdx.y) * C + c] = sum;
  }
}
__global__ void column_sums_add_kernel(float* dw, const float* partial, int64_t chunks, int64_t C) {
  GRID_STRIDE(c, C) {
    float sum = 0;
    for (int64_t k = 0; k < chunks; ++k) sum += partial[k * C + c];
    dw[c] += sum;
  }
}

// ---- RoPE --------------------------------------------------------------------------------------

// KIND 0 / 1 / 2: out (forward) or din (backward) in fp32 / bf16 / fp16, rounded as convert()
// rounds; into 16 bits the backward only overwrites (the host refuses accumulate there).
template <int KIND>
__global__ void rope_forward_kernel(dev::Storage<KIND>* out, int64_t out_ts, int64_t out_hs, const float* in,
                                    int64_t in_ts, int64_t in_hs, const float* cos, const float* sin, int64_t N,
                                    int64_t S, int64_t heads, int64_t dr, bool interleave) {
  const int64_t half = dr / 2;
  GRID_STRIDE(i, N * heads * half) {
    const int64_t j = i % half, h = (i / half) % heads, t = i / (half * heads);
    const float* x = in + t * in_ts + h * in_hs;
    dev::Storage<KIND>* o = out + t * out_ts + h * out_hs;
    const float c = cos[(t % S) * half + j], s = sin[(t % S) * half + j];
    float o1, o2;
    dev::rope_rotate(x[dev::rope_first(j, dr, interleave)], x[dev::rope_second(j, dr, interleave)], c, s, &o1, &o2);
    o[j] = dev::store_as<KIND>(o1);
    o[j + half] = dev::store_as<KIND>(o2);
  }
}
template <int KIND>
__global__ void rope_backward_kernel(dev::Storage<KIND>* din, int64_t in_ts, int64_t in_hs, const float* dout,
                                     int64_t out_ts, int64_t out_hs, const float* cos, const float* sin, int64_t N,
                                     int64_t S, int64_t heads, int64_t dr, bool interleave, bool accumulate) {
  const int64_t half = dr / 2;
  GRID_STRIDE(i, N * heads * half) {
    const int64_t j = i % half, h = (i / half) % heads, t = i / (half * heads);
    const float* g = dout + t * out_ts + h * out_hs;
    dev::Storage<KIND>* dx = din + t * in_ts + h * in_hs;
    const float c = cos[(t % S) * half + j], s = sin[(t % S) * half + j];
    float da, db;
    dev::rope_rotate_back(g[j], g[j + half], c, s, &da, &db);
    dev::Storage<KIND>& xa = dx[dev::rope_first(j, dr, interleave)];
    dev::Storage<KIND>& xb = dx[dev::rope_second(j, dr, interleave)];
    if constexpr (KIND == 0) {
      xa = accumulate ? xa + da : da;
      xb = accumulate ? xb + db : db;
    } else {
      xa = dev::store_as<KIND>(da);
      xb = dev::store_as<KIND>(db);
    }
  }
}
// The same when every head's gradient goes to one shared row (in_hs = 0: MLA's rope key, one per
// token for all heads): a thread per (t, j) adds the heads in order, as the CPU loop does — a
// thread per head would race on the row.
__global__ void rope_backward_shared_kernel(float* din, int64_t in_ts, const float* dout, int64_t out_ts,
                                            int64_t out_hs, const float* cos, const float* sin, int64_t N,
                                            int64_t S, int64_t heads, int64_t dr, bool interleave, bool accumulate) {
  const int64_t half = dr / 2;
  GRID_STRIDE(i, N * half) {
    const int64_t j = i % half, t = i / half;
    const float c = cos[(t % S) * half + j], s = sin[(t % S) * half + j];
    float& xa = din[t * in_ts + dev::rope_first(j, dr, interleave)];
    float& xb = din[t * in_ts + dev::rope_second(j, dr, interleave)];
    float a = xa, b = xb;
    for (int64_t h = 0; h < heads; ++h) {
      const float* g = dout + t * out_ts + h * out_hs;
      float da, db;
      dev::rope_rotate_back(g[j], g[j + half], c, s, &da, &db);
      a = accumulate ? a + da : da;
      b = accumulate ? b + db : db;
    }
    xa = a, xb = b;
  }
}

// ---- Attention: one warp per row ---------------------------------------------------------------

constexpr int kAttnWarps = 4;  // warps (rows) per block

template <int KIND>
__global__ void attention_forward_kernel(float* O, float* lse, const dev::Storage<KIND>* Q,
                                         const dev::Storage<KIND>* K, const dev::Storage<KIND>* V, dev::AttnShape a) {
  const int64_t row = int64_t(blockIdx.x) * kAttnWarps + threadIdx.x / 32;
  if (row >= a.B * a.nh * a.S) return;
  const int64_t i = row % a.S, h = (row / a.S) % a.nh, b = row / (a.S * a.nh);
  dev::attention_forward_row<KIND, 32, kMaxHeadDim>(O, lse, Q, K, V, a, b, h, i, int(threadIdx.x % 32), WarpSum{});
}
__global__ void attention_rowsum_kernel(float* D, const float* dO, const float* O, dev::AttnShape a) {
  const int64_t row = int64_t(blockIdx.x) * kAttnWarps + threadIdx.x / 32;
  if (row >= a.B * a.nh * a.S) return;
  const int64_t i = row % a.S, h = (row / a.S) % a.nh, b = row / (a.S * a.nh);
  dev::attention_rowsum<32>(D, dO, O, a, b, h, i, int(threadIdx.x % 32), WarpSum{});
}
template <int KIND>
__global__ void attention_backward_dq_kernel(float* dQ, const dev::Storage<KIND>* dO, const dev::Storage<KIND>* Q,
                                             const dev::Storage<KIND>* K, const dev::Storage<KIND>* V,
                                             const float* lse, const float* D, dev::AttnShape a) {
  const int64_t row = int64_t(blockIdx.x) * kAttnWarps + threadIdx.x / 32;
  if (row >= a.B * a.nh * a.S) return;
  const int64_t i = row % a.S, h = (row / a.S) % a.nh, b = row / (a.S * a.nh);
  dev::attention_backward_dq_row<KIND, 32, kMaxHeadDim>(dQ, dO, Q, K, V, lse, D, a, b, h, i, int(threadIdx.x % 32),
                                                         WarpSum{});
}
template <int KIND>
__global__ void attention_backward_dkv_kernel(float* dK, float* dV, const dev::Storage<KIND>* dO,
                                              const dev::Storage<KIND>* Q, const dev::Storage<KIND>* K,
                                              const dev::Storage<KIND>* V, const float* lse, const float* D,
                                              dev::AttnShape a) {
  const int64_t row = int64_t(blockIdx.x) * kAttnWarps + threadIdx.x / 32;
  if (row >= a.B * a.nh * a.S) return;
  const int64_t j = row % a.S, h = (row / a.S) % a.nh, b = row / (a.S * a.nh);
  dev::attention_backward_dkv_row<KIND, 32, kMaxHeadDim>(dK, dV, dO, Q, K, V, lse, D, a, b, h, j,
                                                          int(threadIdx.x % 32), WarpSum{});
}

// ---- Attention: 16-bit tiles on tensor cores (device_math.h "tiled") ---------------------------

template <int KIND>
struct MmaType;
template <>
struct MmaType<1> {
  using type = __nv_bfloat16;
};
template <>
struct MmaType<2> {
  using type = __half;
};

constexpr int kFlashWarps = dev::kFlashRows / 16;  // 4
constexpr int kFlashThreads = 32 * kFlashWarps;

// Rows [first, first + n) of one head (row stride `stride` elements, d wide) into a shared tile
// of n rows with row stride ld; rows at or past S are zero.
__device__ void flash_load(uint16_t* tile, int ld, const uint16_t* src, int64_t stride, int64_t first, int n,
                           int64_t S, int d) {
  // 16 bytes per thread where the head's rows start 16-byte aligned (d, stride and ld are
  // multiples of 8 elements: tiled_attention's multiples of 16).
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int per_row = d / 8;
    for (int idx = threadIdx.x; idx < n * per_row; idx += blockDim.x) {
      const int r = idx / per_row, c = (idx % per_row) * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (first + r < S) v = *reinterpret_cast<const uint4*>(src + (first + r) * stride + c);
      *reinterpret_cast<uint4*>(tile + r * ld + c) = v;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < n * d; idx += blockDim.x) {
    const int r = idx / d, c = idx % d;
    tile[r * ld + c] = first + r < S ? src[(first + r) * stride + c] : uint16_t(0);
  }
}

// One warp: its 16 rows of an fp32 shared tile (row stride ld, d wide) out to rows r0.. of one
// head (row stride `stride`), rows at or past S left alone.
__device__ void flash_store(float* dst, int64_t stride, const float* tile, int ld, int64_t r0, int64_t S, int d,
                            int lane) {
  for (int idx = lane; idx < 16 * d; idx += 32) {
    const int r = idx / d, c = idx % d;
    if (r0 + r < S) dst[(r0 + r) * stride + c] = tile[r * ld + c];
  }
}

// One warp: S[16 x kFlashCols] (float, row stride kFlashLdS) = A[16 x d] B[kFlashCols x d]^T,
// A and B row-major 16-bit tiles. The four column blocks accumulate side by side (four
// independent MMA chains, each A fragment loaded once).
template <int KIND>
__device__ void flash_scores(float* S, const uint16_t* A, int lda, const uint16_t* B, int ldb, int d) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // bf16 MMAs (the launch checks the device)
  using T = typename MmaType<KIND>::type;
  namespace w = nvcuda::wmma;
  constexpr int kBlocks = dev::kFlashCols / 16;
  w::fragment<w::accumulator, 16, 16, 16, float> acc[kBlocks];
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) w::fill_fragment(acc[n], 0.0f);
  for (int k = 0; k < d; k += 16) {
    w::fragment<w::matrix_a, 16, 16, 16, T, w::row_major> a;
    w::load_matrix_sync(a, reinterpret_cast<const T*>(A + k), lda);
#pragma unroll
    for (int n = 0; n < kBlocks; ++n) {
      w::fragment<w::matrix_b, 16, 16, 16, T, w::col_major> b;  // B^T: element (k, n) at B[n * ldb + k]
      w::load_matrix_sync(b, reinterpret_cast<const T*>(B + n * 16 * ldb + k), ldb);
      w::mma_sync(acc[n], a, b, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) w::store_matrix_sync(S + n * 16, acc[n], dev::kFlashLdS, w::mem_row_major);
#else
  __trap();
#endif
}

// One warp: C[16 x n] (float, row stride ldc) += P[16 x kFlashCols] (16-bit, row stride
// kFlashLdP) X[kFlashCols x n] (16-bit, row-major, row stride ldx). P's fragments are loaded
// once; two column blocks of C accumulate side by side where there are two.
template <int KIND>
__device__ void flash_accumulate(float* C, int ldc, const uint16_t* P, const uint16_t* X, int ldx, int n_cols) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  using T = typename MmaType<KIND>::type;
  namespace w = nvcuda::wmma;
  constexpr int kSteps = dev::kFlashCols / 16;
  w::fragment<w::matrix_a, 16, 16, 16, T, w::row_major> a[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) w::load_matrix_sync(a[k], reinterpret_cast<const T*>(P + k * 16), dev::kFlashLdP);
  int n = 0;
  for (; n + 32 <= n_cols; n += 32) {
    w::fragment<w::accumulator, 16, 16, 16, float> c0, c1;
    w::load_matrix_sync(c0, C + n, ldc, w::mem_row_major);
    w::load_matrix_sync(c1, C + n + 16, ldc, w::mem_row_major);
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      w::fragment<w::matrix_b, 16, 16, 16, T, w::row_major> b0, b1;
      w::load_matrix_sync(b0, reinterpret_cast<const T*>(X + k * 16 * ldx + n), ldx);
      w::load_matrix_sync(b1, reinterpret_cast<const T*>(X + k * 16 * ldx + n + 16), ldx);
      w::mma_sync(c0, a[k], b0, c0);
      w::mma_sync(c1, a[k], b1, c1);
    }
    w::store_matrix_sync(C + n, c0, ldc, w::mem_row_major);
    w::store_matrix_sync(C + n + 16, c1, ldc, w::mem_row_major);
  }
  for (; n < n_cols; n += 16) {
    w::fragment<w::accumulator, 16, 16, 16, float> c0;
    w::load_matrix_sync(c0, C + n, ldc, w::mem_row_major);
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      w::fragment<w::matrix_b, 16, 16, 16, T, w::row_major> b0;
      w::load_matrix_sync(b0, reinterpret_cast<const T*>(X + k * 16 * ldx + n), ldx);
      w::mma_sync(c0, a[k], b0, c0);
    }
    w::store_matrix_sync(C + n, c0, ldc, w::mem_row_major);
  }
#else
  __trap();
#endif
}

// Shared-memory carving shared by the kernels and the launches (bytes, each region a multiple
// of 128 bytes so every WMMA pointer is 32-byte aligned).
struct FlashSmem {
  int64_t bytes = 0;
  __host__ __device__ int64_t take(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + 127) / 128 * 128;
    return at;
  }
};
__host__ __device__ inline int flash_ld16(int64_t d) { return int(d) + 8; }  // 16-bit tile row stride
__host__ __device__ inline int flash_ld32(int64_t d) { return int(d) + 4; }  // float tile row stride
// Forward: Q, K, V tiles, per warp a score tile and an O accumulator.
struct FlashFwdLayout {
  int64_t q, k, v, s, o, bytes;
  __host__ __device__ FlashFwdLayout(int64_t dqk, int64_t dv) {
    FlashSmem m;
    q = m.take(2 * dev::kFlashRows * flash_ld16(dqk)), k = m.take(2 * dev::kFlashCols * flash_ld16(dqk));
    v = m.take(2 * dev::kFlashCols * flash_ld16(dv));
    s = m.take(4 * kFlashWarps * 16 * dev::kFlashLdS), o = m.take(4 * kFlashWarps * 16 * flash_ld32(dv));
    bytes = m.bytes;
  }
};
// dQ: Q, dO, K, V tiles, per warp score and dP tiles and a dQ accumulator.
struct FlashDqLayout {
  int64_t q, g, k, v, s, p, acc, bytes;
  __host__ __device__ FlashDqLayout(int64_t dqk, int64_t dv) {
    FlashSmem m;
    q = m.take(2 * dev::kFlashRows * flash_ld16(dqk)), g = m.take(2 * dev::kFlashRows * flash_ld16(dv));
    k = m.take(2 * dev::kFlashCols * flash_ld16(dqk)), v = m.take(2 * dev::kFlashCols * flash_ld16(dv));
    s = m.take(4 * kFlashWarps * 16 * dev::kFlashLdS), p = m.take(4 * kFlashWarps * 16 * dev::kFlashLdS);
    acc = m.take(4 * kFlashWarps * 16 * flash_ld32(dqk));
    bytes = m.bytes;
  }
};
// dK / dV: the block's K, V rows, the query tile's Q, dO, L, D, per warp two score tiles and the
// dK, dV accumulators.
struct FlashDkvLayout {
  int64_t k, v, q, g, l, d, s, p, dk, dv, bytes;
  __host__ __device__ FlashDkvLayout(int64_t dqk, int64_t dvv) {
    FlashSmem m;
    k = m.take(2 * dev::kFlashRows * flash_ld16(dqk)), v = m.take(2 * dev::kFlashRows * flash_ld16(dvv));
    q = m.take(2 * dev::kFlashCols * flash_ld16(dqk)), g = m.take(2 * dev::kFlashCols * flash_ld16(dvv));
    l = m.take(4 * dev::kFlashCols), d = m.take(4 * dev::kFlashCols);
    s = m.take(4 * kFlashWarps * 16 * dev::kFlashLdS), p = m.take(4 * kFlashWarps * 16 * dev::kFlashLdS);
    dk = m.take(4 * kFlashWarps * 16 * flash_ld32(dqk)), dv = m.take(4 * kFlashWarps * 16 * flash_ld32(dvv));
    bytes = m.bytes;
  }
};

// Grid (query blocks, heads, sequences).
template <int KIND>
__global__ void __launch_bounds__(kFlashThreads)
    attention_tiled_forward_kernel(float* O, float* lse, const uint16_t* Q, const uint16_t* K, const uint16_t* V,
                                   dev::AttnShape a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FlashFwdLayout lay(a.dqk, a.dv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, dqk = int(a.dqk), dv = int(a.dv);
  const int ldq = flash_ld16(dqk), ldv = flash_ld16(dv), ldo = flash_ld32(dv);
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t(blockIdx.x) * dev::kFlashRows;
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv;
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + lay.q);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + lay.k);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + lay.v);
  float* Ss = reinterpret_cast<float*>(smem + lay.s) + warp * 16 * dev::kFlashLdS;
  float* Os = reinterpret_cast<float*>(smem + lay.o) + warp * 16 * ldo;
  const uint16_t* Kb = K + b * a.S * qs + h * a.dqk;
  const uint16_t* Vb = V + b * a.S * vs + h * a.dv;
  flash_load(Qs, ldq, Q + b * a.S * qs + h * a.dqk, qs, i0, dev::kFlashRows, a.S, dqk);
  const int64_t r0 = i0 + warp * 16, i = r0 + dev::flash_lane_row(lane);
  const int64_t tiles = dev::flash_key_tiles(i0, a.S);
  float s[dev::kFlashLane];
  float m = dev::neg_inf(), l = 0.0f;
  for (int64_t t = 0; t < tiles; ++t) {  // pass 1: the rows' log-sum-exp
    const int64_t j0 = t * dev::kFlashCols;
    __syncthreads();
    flash_load(Ks, ldq, Kb, qs, j0, dev::kFlashCols, a.S, dqk);
    __syncthreads();
    if (!dev::flash_query_warp_sees(r0, j0, a.S)) continue;
    flash_scores<KIND>(Ss, Qs + warp * 16 * ldq, ldq, Ks, ldq, dqk);
    __syncwarp();
    dev::flash_read_lane(s, Ss, lane);
    if (i < a.S) dev::flash_stats_lane(s, lane, i, j0, a.scale, m, l);
    __syncwarp();
  }
  {  // the row's two halves, merged in the same order on both lanes (the same L bit for bit)
    float m2 = __shfl_xor_sync(0xffffffffu, m, 16), l2 = __shfl_xor_sync(0xffffffffu, l, 16);
    if (lane >= 16) {
      const float tm = m, tl = l;
      m = m2, l = l2, m2 = tm, l2 = tl;
    }
    dev::flash_merge(m, l, m2, l2);
  }
  const float L = m + logf(l);
  for (int idx = lane; idx < 16 * ldo; idx += 32) Os[idx] = 0.0f;
  __syncwarp();
  for (int64_t t = 0; t < tiles; ++t) {  // pass 2: O = P V
    const int64_t j0 = t * dev::kFlashCols;
    __syncthreads();
    flash_load(Ks, ldq, Kb, qs, j0, dev::kFlashCols, a.S, dqk);
    flash_load(Vs, ldv, Vb, vs, j0, dev::kFlashCols, a.S, dv);
    __syncthreads();
    if (!dev::flash_query_warp_sees(r0, j0, a.S)) continue;
    flash_scores<KIND>(Ss, Qs + warp * 16 * ldq, ldq, Ks, ldq, dqk);
    __syncwarp();
    dev::flash_read_lane(s, Ss, lane);
    __syncwarp();
    dev::flash_probs_lane<KIND>(reinterpret_cast<uint16_t*>(Ss), s, lane, i, j0, a.S, a.scale, L);
    __syncwarp();
    flash_accumulate<KIND>(Os, ldo, reinterpret_cast<const uint16_t*>(Ss), Vs, ldv, dv);
    __syncwarp();
  }
  flash_store(O + b * a.S * vs + h * a.dv, vs, Os, ldo, r0, a.S, dv, lane);
  if (lane < 16 && i < a.S) lse[(b * a.nh + h) * a.S + i] = L;
}

// dQ. Grid (query blocks, heads, sequences).
template <int KIND>
__global__ void __launch_bounds__(kFlashThreads)
    attention_tiled_dq_kernel(float* dQ, const uint16_t* dO, const uint16_t* Q, const uint16_t* K, const uint16_t* V,
                              const float* lse, const float* D, dev::AttnShape a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FlashDqLayout lay(a.dqk, a.dv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, dqk = int(a.dqk), dv = int(a.dv);
  const int ldq = flash_ld16(dqk), ldv = flash_ld16(dv), lda = flash_ld32(dqk);
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t(blockIdx.x) * dev::kFlashRows;
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv;
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + lay.q);
  uint16_t* Gs = reinterpret_cast<uint16_t*>(smem + lay.g);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + lay.k);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + lay.v);
  float* Ss = reinterpret_cast<float*>(smem + lay.s) + warp * 16 * dev::kFlashLdS;
  float* Ps = reinterpret_cast<float*>(smem + lay.p) + warp * 16 * dev::kFlashLdS;
  float* Acc = reinterpret_cast<float*>(smem + lay.acc) + warp * 16 * lda;
  flash_load(Qs, ldq, Q + b * a.S * qs + h * a.dqk, qs, i0, dev::kFlashRows, a.S, dqk);
  flash_load(Gs, ldv, dO + b * a.S * vs + h * a.dv, vs, i0, dev::kFlashRows, a.S, dv);
  const uint16_t* Kb = K + b * a.S * qs + h * a.dqk;
  const uint16_t* Vb = V + b * a.S * vs + h * a.dv;
  const int64_t r0 = i0 + warp * 16, i = r0 + dev::flash_lane_row(lane);
  const float L = i < a.S ? lse[(b * a.nh + h) * a.S + i] : 0.0f, Di = i < a.S ? D[(b * a.nh + h) * a.S + i] : 0.0f;
  for (int idx = lane; idx < 16 * lda; idx += 32) Acc[idx] = 0.0f;
  float s[dev::kFlashLane], dp[dev::kFlashLane];
  const int64_t tiles = dev::flash_key_tiles(i0, a.S);
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t j0 = t * dev::kFlashCols;
    __syncthreads();
    flash_load(Ks, ldq, Kb, qs, j0, dev::kFlashCols, a.S, dqk);
    flash_load(Vs, ldv, Vb, vs, j0, dev::kFlashCols, a.S, dv);
    __syncthreads();
    if (!dev::flash_query_warp_sees(r0, j0, a.S)) continue;
    flash_scores<KIND>(Ss, Qs + warp * 16 * ldq, ldq, Ks, ldq, dqk);
    flash_scores<KIND>(Ps, Gs + warp * 16 * ldv, ldv, Vs, ldv, dv);
    __syncwarp();
    dev::flash_read_lane(s, Ss, lane);
    dev::flash_read_lane(dp, Ps, lane);
    __syncwarp();
    dev::flash_dq_lane<KIND>(reinterpret_cast<uint16_t*>(Ss), s, dp, lane, i, j0, a.S, a.scale, L, Di);
    __syncwarp();
    flash_accumulate<KIND>(Acc, lda, reinterpret_cast<const uint16_t*>(Ss), Ks, ldq, dqk);
    __syncwarp();
  }
  flash_store(dQ + b * a.S * qs + h * a.dqk, qs, Acc, lda, r0, a.S, dqk, lane);
}

// dK and dV. Grid (key blocks, heads, sequences).
template <int KIND>
__global__ void __launch_bounds__(kFlashThreads)
    attention_tiled_dkv_kernel(float* dK, float* dV, const uint16_t* dO, const uint16_t* Q, const uint16_t* K,
                               const uint16_t* V, const float* lse, const float* D, dev::AttnShape a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const FlashDkvLayout lay(a.dqk, a.dv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, dqk = int(a.dqk), dv = int(a.dv);
  const int ldq = flash_ld16(dqk), ldv = flash_ld16(dv), ldk32 = flash_ld32(dqk), ldv32 = flash_ld32(dv);
  const int64_t b = blockIdx.z, h = blockIdx.y, j0 = int64_t(blockIdx.x) * dev::kFlashRows;
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv;
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + lay.k);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + lay.v);
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + lay.q);
  uint16_t* Gs = reinterpret_cast<uint16_t*>(smem + lay.g);
  float* Ls = reinterpret_cast<float*>(smem + lay.l);
  float* Ds = reinterpret_cast<float*>(smem + lay.d);
  float* Ss = reinterpret_cast<float*>(smem + lay.s) + warp * 16 * dev::kFlashLdS;
  float* Ps = reinterpret_cast<float*>(smem + lay.p) + warp * 16 * dev::kFlashLdS;
  float* dKs = reinterpret_cast<float*>(smem + lay.dk) + warp * 16 * ldk32;
  float* dVs = reinterpret_cast<float*>(smem + lay.dv) + warp * 16 * ldv32;
  flash_load(Ks, ldq, K + b * a.S * qs + h * a.dqk, qs, j0, dev::kFlashRows, a.S, dqk);
  flash_load(Vs, ldv, V + b * a.S * vs + h * a.dv, vs, j0, dev::kFlashRows, a.S, dv);
  const uint16_t* Qb = Q + b * a.S * qs + h * a.dqk;
  const uint16_t* Gb = dO + b * a.S * vs + h * a.dv;
  const float* Lb = lse + (b * a.nh + h) * a.S;
  const float* Db = D + (b * a.nh + h) * a.S;
  const int64_t r0 = j0 + warp * 16, j = r0 + dev::flash_lane_row(lane);
  for (int idx = lane; idx < 16 * ldk32; idx += 32) dKs[idx] = 0.0f;
  for (int idx = lane; idx < 16 * ldv32; idx += 32) dVs[idx] = 0.0f;
  float st[dev::kFlashLane], dpt[dev::kFlashLane];
  for (int64_t i0 = j0; i0 < a.S; i0 += dev::kFlashCols) {  // the query tiles at or after the block's keys
    __syncthreads();
    flash_load(Qs, ldq, Qb, qs, i0, dev::kFlashCols, a.S, dqk);
    flash_load(Gs, ldv, Gb, vs, i0, dev::kFlashCols, a.S, dv);
    for (int c = threadIdx.x; c < dev::kFlashCols; c += blockDim.x) {
      Ls[c] = i0 + c < a.S ? Lb[i0 + c] : 0.0f;
      Ds[c] = i0 + c < a.S ? Db[i0 + c] : 0.0f;
    }
    __syncthreads();
    if (!dev::flash_key_warp_sees(r0, a.S)) continue;
    flash_scores<KIND>(Ss, Ks + warp * 16 * ldq, ldq, Qs, ldq, dqk);  // S^T = K Q^T
    flash_scores<KIND>(Ps, Vs + warp * 16 * ldv, ldv, Gs, ldv, dv);   // dP^T = V dO^T
    __syncwarp();
    dev::flash_read_lane(st, Ss, lane);
    dev::flash_read_lane(dpt, Ps, lane);
    __syncwarp();
    dev::flash_dkv_lane<KIND>(reinterpret_cast<uint16_t*>(Ss), reinterpret_cast<uint16_t*>(Ps), st, dpt, lane, j, i0,
                              a.S, a.scale, Ls, Ds);
    __syncwarp();
    flash_accumulate<KIND>(dVs, ldv32, reinterpret_cast<const uint16_t*>(Ss), Gs, ldv, dv);   // P^T dO
    flash_accumulate<KIND>(dKs, ldk32, reinterpret_cast<const uint16_t*>(Ps), Qs, ldq, dqk);  // dS^T Q
    __syncwarp();
  }
  flash_store(dK + b * a.S * qs + h * a.dqk, qs, dKs, ldk32, r0, a.S, dqk, lane);
  flash_store(dV + b * a.S * vs + h * a.dv, vs, dVs, ldv32, r0, a.S, dv, lane);
}

// ---- SwiGLU, router, MoE data movement ---------------------------------------------------------

// f(kind, p) with kind = std::integral_constant<int, KIND> for the View's storage type (KIND 0 /
// 1 / 2: fp32 / bf16 / fp16) and p its data as Storage<KIND>*: the launch of a kernel templated on
// its output type, written once.
template <class F>
void with_storage(View v, F&& f) {
  switch (v.dtype) {
    case DType::kF32: return f(std::integral_constant<int, 0>{}, static_cast<float*>(v.data));
    case DType::kBF16: return f(std::integral_constant<int, 1>{}, static_cast<uint16_t*>(v.data));
    case DType::kF16: return f(std::integral_constant<int, 2>{}, static_cast<uint16_t*>(v.data));
  }
}

// KIND 0 / 1 / 2: M in fp32 / bf16 / fp16 (rounded as convert() rounds).
template <int KIND>
__global__ void swiglu_forward_kernel(dev::Storage<KIND>* M, const float* GU, int64_t N, int64_t I) {
  GRID_STRIDE(x, N * I) {
    const int64_t t = x / I, i = x % I;
    M[x] = dev::store_as<KIND>(dev::swiglu(GU[t * 2 * I + i], GU[t * 2 * I + I + i]));
  }
}
template <int KIND>
__global__ void swiglu_backward_kernel(dev::Storage<KIND>* dGU, const float* dM, const float* GU, int64_t N,
                                       int64_t I) {
  GRID_STRIDE(x, N * I) {
    const int64_t t = x / I, i = x % I;
    float dg, du;
    dev::swiglu_grad(dM[x], GU[t * 2 * I + i], GU[t * 2 * I + I + i], &dg, &du);
    dGU[t * 2 * I + i] = dev::store_as<KIND>(dg);
    dGU[t * 2 * I + I + i] = dev::store_as<KIND>(du);
  }
}
__global__ void router_forward_kernel(int32_t* idx, float* w, float* scores, const float* logits, const float* bias,
                                      int64_t N, RouterParams p) {
  GRID_STRIDE(t, N) {
    dev::router_forward_row<kMaxExperts, kMaxGroups>(idx + t * p.top_k, w + t * p.top_k, scores + t * p.num_experts,
                                         logits + t * p.num_experts, bias, p);
  }
}
__global__ void router_backward_kernel(float* dlogits, const float* dw, const float* dscores_extra,
                                       const float* scores, const int32_t* idx, int64_t N, RouterParams p) {
  GRID_STRIDE(t, N) {
    dev::router_backward_row(dlogits + t * p.num_experts, dw + t * p.top_k,
                                          dscores_extra ? dscores_extra + t * p.num_experts : nullptr,
                                          scores + t * p.num_experts, idx + t * p.top_k, p);
  }
}
// ---- MoE dispatch plan and balance loss on the device -----------------------------------------

__global__ void iota_kernel(int32_t* x, int64_t n) {
  GRID_STRIDE(i, n) x[i] = int32_t(i);
}
// The slots sorted by expert (stably: in (token, slot) order within an expert) become the plan.
__global__ void plan_scatter_kernel(int32_t* pos, int32_t* src, const int32_t* slots, int64_t n, int64_t k) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int32_t slot = slots[r];
  src[r] = int32_t(slot / k);
  pos[slot] = int32_t(r);
}
// counts[e] = the sorted experts equal to e (two binary searches).
__global__ void plan_counts_kernel(int32_t* counts, const int32_t* sorted, int64_t n, int64_t E) {
  const int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  const auto lower = [&](int64_t v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (sorted[mid] < v) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  };
  counts[e] = int32_t(lower(e + 1) - lower(e));
}

__global__ void balance_rowsum_kernel(double* rowsum, const float* scores, int64_t n, int64_t E) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  rowsum[i] = dev::balance_row_sum(scores + i * E, E);
}
// One thread per (group, expert), over the group's tokens in order: the CPU's sums, term by term.
__global__ void balance_stats_kernel(float* stats, const int32_t* idx, const float* scores, const double* rowsum,
                                     Backend::BalanceShape b) {
  const int64_t id = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= b.groups * b.E) return;
  double f = 0, P = 0;
  dev::balance_stats_cell(&f, &P, idx, scores, rowsum, b, id / b.E, id % b.E);
  stats[id] = float(f);
  stats[b.groups * b.E + id] = float(P);
}
__global__ void balance_grad_kernel(float* dscores, const float* stats, const float* scores, Backend::BalanceShape b,
                                    double weight, double grad_scale) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= b.n) return;
  dev::balance_grad_row(dscores + i * b.E, stats + dev::balance_group_of(b, i) * b.E, scores + i * b.E, b, weight,
                        grad_scale);
}
__global__ void balance_aux_kernel(float* aux, const float* stats, Backend::BalanceShape b, double weight) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  aux[0] = float(double(aux[0]) + dev::balance_aux_total(stats, b, weight));
}

template <int KIND>
__global__ void gather_rows_kernel(dev::Storage<KIND>* out, const float* in, const int32_t* src, int64_t n, int64_t H) {
  GRID_STRIDE(x, n * H) out[x] = dev::store_as<KIND>(in[int64_t(src[x / H]) * H + x % H]);
}
__global__ void moe_combine_kernel(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N,
                                   int64_t k, int64_t H) {
  GRID_STRIDE(x, N * H) {
    const int64_t t = x / H, c = x % H;
    float o = out[x];
    for (int64_t j = 0; j < k; ++j) o += w[t * k + j] * Y[int64_t(pos[t * k + j]) * H + c];
    out[x] = o;
  }
}
// One warp per (token, choice); dY in fp32 / bf16 / fp16 (KIND 0 / 1 / 2).
template <int KIND>
__global__ void moe_combine_backward_kernel(dev::Storage<KIND>* dY, float* dw, const float* dout, const float* Y,
                                            const float* w, const int32_t* pos, int64_t N, int64_t k, int64_t H) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  // Warp-strided (the grid is capped): the loop condition is the same for a warp's 32 lanes.
  for (int64_t tj = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; tj < N * k; tj += warps) {
    const int64_t t = tj / k, row = pos[tj];
    const float wj = w[tj];
    float dot = 0;
    for (int64_t c = lane; c < H; c += 32) {
      const float g = dout[t * H + c];
      dot += g * Y[row * H + c];
      dY[row * H + c] = dev::store_as<KIND>(wj * g);
    }
    dot = warp_sum(dot);
    if (lane == 0) dw[tj] = dot;
  }
}
__global__ void moe_dispatch_backward_kernel(float* dx, const float* dXp, const int32_t* pos, int64_t N, int64_t k,
                                             int64_t H) {
  GRID_STRIDE(x, N * H) {
    const int64_t t = x / H, c = x % H;
    float d = dx[x];
    for (int64_t j = 0; j < k; ++j) d += dXp[int64_t(pos[t * k + j]) * H + c];
    dx[x] = d;
  }
}

// ---- Cross-entropy: one block per row ------------------------------------------------------------

__global__ void cross_entropy_kernel(float* loss, float* logits, const int32_t* target, int64_t V, float gs) {
  const int64_t r = blockIdx.x;
  float* l = logits + r * V;
  const int32_t y = target[r];
  if (y < 0) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) l[v] = 0.0f;
    if (threadIdx.x == 0) loss[r] = 0.0f;
    return;
  }
  float mx = dev::neg_inf();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, l[v]);
  mx = block_reduce<true>(mx);
  float sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) sum += expf(l[v] - mx);
  sum = block_reduce<false>(sum);
  const float lse = mx + logf(sum), ly = l[y];
  __syncthreads();  // every thread has read l[y] before it is overwritten
  if (threadIdx.x == 0) loss[r] = lse - ly;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) l[v] = expf(l[v] - lse) * gs - (v == y ? gs : 0.0f);
}
__global__ void ce_row_max_kernel(float* row_max, const float* logits, int64_t V) {
  const int64_t r = blockIdx.x;
  float mx = dev::neg_inf();
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, logits[r * V + v]);
  mx = block_reduce<true>(mx);
  if (threadIdx.x == 0) row_max[r] = mx;
}
__global__ void ce_row_sums_kernel(float* sums, const float* logits, const float* row_max, const int32_t* target,
                                   int64_t v0, int64_t V) {
  const int64_t r = blockIdx.x;
  const float* l = logits + r * V;
  const float mx = row_max[r];
  float sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) sum += expf(l[v] - mx);
  sum = block_reduce<false>(sum);
  if (threadIdx.x == 0) {
    const int64_t y = int64_t(target[r]) - v0;
    sums[2 * r] = sum;
    sums[2 * r + 1] = target[r] >= 0 && y >= 0 && y < V ? l[y] : 0.0f;
  }
}
__global__ void ce_finish_kernel(float* loss, float* logits, const float* row_max, const float* sums,
                                 const int32_t* target, int64_t v0, int64_t V, float gs) {
  const int64_t r = blockIdx.x;
  float* l = logits + r * V;
  if (target[r] < 0) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) l[v] = 0.0f;
    if (threadIdx.x == 0) loss[r] = 0.0f;
    return;
  }
  const float lse = row_max[r] + logf(sums[2 * r]);
  if (threadIdx.x == 0) loss[r] = lse - sums[2 * r + 1];
  const int64_t y = int64_t(target[r]) - v0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) l[v] = expf(l[v] - lse) * gs - (v == y ? gs : 0.0f);
}

// ---- Embedding ---------------------------------------------------------------------------------

__global__ void embedding_forward_kernel(float* out, const float* table, const int32_t* ids, int64_t N, int64_t H) {
  GRID_STRIDE(x, N * H) {
    const int32_t id = ids[x / H];
    out[x] = id < 0 ? 0.0f : table[int64_t(id) * H + x % H];
  }
}
// Over the tokens sorted by id (a stable sort: equal ids keep token order): a thread per (sorted
// position, column); the one at the start of a run of equal ids adds the run's rows into the
// table row in token order, as the CPU loop does. (A thread per column walking every token, as
// before, used H threads of the GPU for a whole step's tokens.)
__global__ void embedding_backward_runs_kernel(float* dtable, const float* dout, const int32_t* sorted_ids,
                                               const int32_t* sorted_tokens, int64_t N, int64_t H) {
  GRID_STRIDE(i, N * H) {
    const int64_t c = i % H, p = i / H;
    const int32_t id = sorted_ids[p];
    if (id < 0 || (p > 0 && sorted_ids[p - 1] == id)) continue;  // another shard's row, or not a run's start
    float* d = dtable + int64_t(id) * H + c;
    float acc = *d;
    for (int64_t q = p; q < N && sorted_ids[q] == id; ++q) acc += dout[int64_t(sorted_tokens[q]) * H + c];
    *d = acc;
  }
}

// ---- Sum of squares in double: fixed grid, fixed order -----------------------------------------

// The grid is part of the result's definition: the same n (and alignment) gives the same bits.
// 8 blocks per H200 multiprocessor, each thread reading 16 bytes at a time: enough loads in
// flight to stream at HBM bandwidth (264 blocks of scalar loads, the first version, kept about a
// tenth of that in flight by Little's law: some 20-50 ms for the 4.6G gradients of the h200 preset).
constexpr int kSumBlocks = 1056;

__device__ double block_sum_double(double x) {
  __shared__ double part[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = x;
  __syncthreads();
  double t = part[0];
  for (int i = 1; i < kThreads / 32; ++i) t += part[i];
  return t;
}
__global__ void sum_squares_partial_kernel(double* partials, const float* x, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  // A head of up to 3 floats up to the first 16-byte boundary (ZeRO shards and tensors start at
  // any offset), the body as float4, the tail: a fixed function of (n, x % 16), so deterministic.
  int64_t head = int64_t((16 - reinterpret_cast<uintptr_t>(x) % 16) % 16 / 4);
  if (head > n) head = n;
  if (reinterpret_cast<uintptr_t>(x) % 4 != 0) head = n;  // not even float-aligned: all scalar
  GRID_STRIDE(i, head) s0 += double(x[i]) * double(x[i]);
  const int64_t body = (n - head) / 4;
  const float4* x4 = reinterpret_cast<const float4*>(x + head);
  GRID_STRIDE(i, body) {
    const float4 v = x4[i];
    s0 += double(v.x) * double(v.x), s1 += double(v.y) * double(v.y);
    s2 += double(v.z) * double(v.z), s3 += double(v.w) * double(v.w);
  }
  const int64_t done = head + body * 4;
  GRID_STRIDE(i, n - done) s0 += double(x[done + i]) * double(x[done + i]);
  double s = block_sum_double((s0 + s1) + (s2 + s3));
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
__global__ void sum_squares_final_kernel(double* out, const double* partials, bool accumulate) {
  double s = 0;
  for (int i = threadIdx.x; i < kSumBlocks; i += blockDim.x) s += partials[i];
  s = block_sum_double(s);
  if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

// ---- cuBLASLt ----------------------------------------------------------------------------------

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kF32: return CUDA_R_32F;
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kF16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// The largest power of two (up to 256) dividing the address: cuBLASLt's heuristics want the
// operands' alignment, and views into buffers may sit at any 4-byte offset.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al) al /= 2;
  return al;
}

struct GemmKey {
  int64_t M, N, K;
  bool ta, tb;
  DType dtype;
  uint32_t al_a, al_b, al_c;
  bool operator<(const GemmKey& o) const {
    return std::tie(M, N, K, ta, tb, dtype, al_a, al_b, al_c) <
           std::tie(o.M, o.N, o.K, o.ta, o.tb, o.dtype, o.al_a, o.al_b, o.al_c);
  }
};

// One problem shape's descriptors and the algorithm the heuristic chose, kept for the
// backend's life (heuristics cached per shape).
struct GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// ---- The backend -------------------------------------------------------------------------------

// One grouped GEMM call's arguments for cublasGemmGroupedBatchedEx (host arrays, one group per
// problem; the pointers go to the device in one copy).
struct GroupArgs {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  std::vector<const void*> ptrs;  // A' (our B), B' (our A), C: one block each
};

// monitor.op_breakdown on the GPU (Backend::set_op_timing): a pair of CUDA events recorded on the
// stream around each op, read back by take() once the stream has finished. As on the CPU
// (dstrain/kernels/op_times.h), a Scope counts only when no other is open, so an op built of
// other ops counts once, under its own name. Off, a Scope costs one relaxed load.
class EventOpTimes {
 public:
  cudaStream_t stream = nullptr;  // the backend's
  ~EventOpTimes() {
    for (const Record& r : records_) cudaEventDestroy(r.start), cudaEventDestroy(r.end);
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  void set(bool on) { on_.store(on, std::memory_order_relaxed); }

  // The device time per op of the ops timed since the last call, largest first (waits for them).
  std::vector<OpTime> take() {
    DS_CUDA(cudaStreamSynchronize(stream));
    std::lock_guard<std::mutex> lock(mu_);
    std::map<std::string, OpTime> totals;
    for (const Record& r : records_) {
      float ms = 0;
      DS_CUDA(cudaEventElapsedTime(&ms, r.start, r.end));
      OpTime& t = totals[r.op];
      t.op = r.op;
      ++t.calls;
      t.ms += double(ms);
      pool_.push_back(r.start), pool_.push_back(r.end);
    }
    records_.clear();
    std::vector<OpTime> out;
    for (const auto& [op, t] : totals) out.push_back(t);
    std::stable_sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
    return out;
  }

  class Scope {
   public:
    Scope(EventOpTimes& t, const char* op) {
      if (!t.on_.load(std::memory_order_relaxed)) return;
      open_ = &t.open_;
      if (open_->fetch_add(1) > 0) return;  // inside another op: that one counts
      t_ = &t;
      op_ = op;
      start_ = t.event();
      DS_CUDA(cudaEventRecord(start_, t.stream));
    }
    ~Scope() {
      if (!open_) return;
      if (t_) {
        const cudaEvent_t end = t_->event();
        if (cudaEventRecord(end, t_->stream) == cudaSuccess) t_->add(op_, start_, end);  // (no throw here)
      }
      open_->fetch_sub(1);
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    EventOpTimes* t_ = nullptr;
    std::atomic<int>* open_ = nullptr;
    const char* op_ = nullptr;
    cudaEvent_t start_ = nullptr;
  };

 private:
  struct Record {
    const char* op;  // (the ops' names are literals)
    cudaEvent_t start, end;
  };
  cudaEvent_t event() {
    std::lock_guard<std::mutex> lock(mu_);
    if (pool_.empty()) {
      cudaEvent_t e = nullptr;
      DS_CUDA(cudaEventCreate(&e));
      return e;
    }
    const cudaEvent_t e = pool_.back();
    pool_.pop_back();
    return e;
  }
  void add(const char* op, cudaEvent_t start, cudaEvent_t end) {
    std::lock_guard<std::mutex> lock(mu_);
    records_.push_back({op, start, end});
  }
  std::atomic<bool> on_{false};
  std::atomic<int> open_{0};
  std::mutex mu_;
  std::vector<Record> records_;
  std::vector<cudaEvent_t> pool_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    DS_CUDA(cudaSetDevice(device_));
    cudaDeviceProp prop{};
    DS_CUDA(cudaGetDeviceProperties(&prop, device_));
    device_name_ = prop.name;
    sms_ = prop.multiProcessorCount;
    cc_major_ = prop.major;
    smem_optin_ = int64_t(prop.sharedMemPerBlockOptin);
    DS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    times_.stream = stream_;
    DS_LT(cublasLtCreate(&lt_));
    DS_LT(cublasCreate(&blas_));
    DS_LT(cublasSetStream(blas_, stream_));
    workspace_ = allocate(kWorkspaceBytes);
    partials_ = static_cast<double*>(allocate(kSumBlocks * int64_t(sizeof(double))));
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    if (cudnn_) cudnn_plugin().close(cudnn_);
    for (auto& [key, plan] : plans_) destroy(plan);
    cublasLtDestroy(lt_);
    cublasDestroy(blas_);
    if (group_ptrs_) deallocate(group_ptrs_);
    deallocate(workspace_);
    deallocate(partials_);
    if (plan_buf_) deallocate(plan_buf_);
    for (auto& [size, b] : free_) cudaFree(b.p);
    for (auto& [p, b] : used_) cudaFree(p);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    int driver = 0, runtime = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    const auto v = [](int x) { return std::to_string(x / 1000) + "." + std::to_string(x % 1000 / 10); };
    return "cuda (" + device_name_ + ", device " + std::to_string(device_) + ", driver " + v(driver) + ", runtime " +
           v(runtime) + ", cuBLASLt " + std::to_string(cublasLtGetVersion()) + ")";
  }
  int num_threads() const override { return sms_; }
  std::string op_timing_clock() const override { return "CUDA events"; }
  void set_op_timing(bool on) override { times_.set(on); }
  std::vector<OpTime> take_op_times() override { return times_.take(); }

  // Caching pool. Sizes round up to 512 bytes (2 MiB above 1 MiB); a request takes the smallest
  // cached block of at least its size and at most twice it, else cudaMalloc — after freeing the
  // whole cache and trying again when the device is full. A cached block that operations on
  // other streams used (record_use: NCCL's) is handed out only once they have finished, or
  // with the compute stream made to wait for them (cudaStreamWaitEvent): never to a kernel
  // that could run while a collective still reads or writes it. DSTRAIN_CUDA_POISON=1 fills
  // every block handed out with 0xFF bytes (NaN in fp32, bf16 and fp16), so a read of memory
  // nothing wrote shows as NaN instead of a previous tensor's values.
  void* allocate(int64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t want = std::max<int64_t>(bytes, 1);
    const int64_t size = want > (1 << 20) ? (want + (2 << 20) - 1) / (2 << 20) * (2 << 20) : (want + 511) / 512 * 512;
    void* p = nullptr;
    int64_t got = size;
    for (auto it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size; ++it) {
      if (!ordered_after_uses(it->second)) continue;
      p = it->second.p, got = it->first;
      cached_ -= got;
      free_.erase(it);
      break;
    }
    if (!p) {
      if (cudaMalloc(&p, size_t(size)) != cudaSuccess) {
        cudaGetLastError();
        release_cache();
        DS_CUDA(cudaMalloc(&p, size_t(size)));
      }
      ++mallocs_;
    }
    used_[p] = Block{p, got, {}};
    in_use_ += got;
    peak_ = std::max(peak_, in_use_);
    if (poison_) DS_CUDA(cudaMemsetAsync(p, 0xFF, size_t(got), stream_));
    return p;
  }
  // Stream-ordered: the block goes back to the cache at once — later ops on the same stream
  // that reuse it run after the ops that used it; the uses recorded on it from other streams
  // go with it (allocate orders after them).
  void deallocate(void* p) override {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = used_.find(p);
    if (it == used_.end()) throw std::invalid_argument("cuda backend: deallocate of a pointer it did not allocate");
    Block b = std::move(it->second);
    used_.erase(it);
    in_use_ -= b.size;
    cached_ += b.size;
    b.uses.erase(std::remove_if(b.uses.begin(), b.uses.end(),
                                [](const std::shared_ptr<StreamUse>& u) { return u->finished(); }),
                 b.uses.end());
    const int64_t size = b.size;
    free_.emplace(size, std::move(b));
  }
  void record_use(const void* p, std::shared_ptr<StreamUse> use) override {
    if (!p || !use) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = used_.upper_bound(const_cast<void*>(p));
    if (it == used_.begin()) return;
    --it;
    if (static_cast<const char*>(p) < static_cast<const char*>(it->first) + it->second.size)
      it->second.uses.push_back(std::move(use));
  }
  CudaPoolStats pool_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {mallocs_, in_use_, peak_, cached_};
  }

  void copy_to_host(void* host, const void* src, int64_t bytes) override {
    const EventOpTimes::Scope op_scope(times_, "copy_to_host");
    if (bytes <= 0) return;
    DS_CUDA(cudaMemcpyAsync(host, src, size_t(bytes), cudaMemcpyDeviceToHost, stream_));
    DS_CUDA(cudaStreamSynchronize(stream_));
  }
  void copy_from_host(void* dst, const void* host, int64_t bytes) override {
    const EventOpTimes::Scope op_scope(times_, "copy_from_host");
    if (bytes <= 0) return;
    DS_CUDA(cudaMemcpyAsync(dst, host, size_t(bytes), cudaMemcpyHostToDevice, stream_));
    DS_CUDA(cudaStreamSynchronize(stream_));  // the caller may free or reuse `host` when this returns
  }
  void copy(void* dst, const void* src, int64_t bytes) override {
    const EventOpTimes::Scope op_scope(times_, "copy");
    if (bytes > 0) DS_CUDA(cudaMemcpyAsync(dst, src, size_t(bytes), cudaMemcpyDeviceToDevice, stream_));
  }
  bool host_addressable() const override { return false; }
  void* native_stream() override { return stream_; }
  bool is_device_memory(const void* p) const override {
    cudaPointerAttributes a{};
    if (!p || cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();  // clear the error a host pointer may leave on older runtimes
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }
  int64_t device_memory_free() override {
    size_t free = 0, total = 0;
    DS_CUDA(cudaMemGetInfo(&free, &total));
    std::lock_guard<std::mutex> lock(mu_);
    return int64_t(free) + cached_;  // the pool's cached blocks are free for this backend too
  }
  void synchronize() override { DS_CUDA(cudaStreamSynchronize(stream_)); }
  // Two passes with a fixed grid (the same partial sums, in the same order, every time).
  void sum_squares(double* out, const float* x, int64_t n, bool accumulate) override {
    const EventOpTimes::Scope op_scope(times_, "sum_squares");
    sum_squares_partial_kernel<<<kSumBlocks, kThreads, 0, stream_>>>(partials_, x, n);
    sum_squares_final_kernel<<<1, kThreads, 0, stream_>>>(out, partials_, accumulate);
    DS_LAUNCHED();
  }

  void convert(View dst, ConstView src, int64_t n) override {
    const EventOpTimes::Scope op_scope(times_, "convert");
    if (n <= 0) return;
    if (dst.dtype == src.dtype) {
      DS_CUDA(cudaMemcpyAsync(dst.data, src.data, size_t(n * dtype_size(src.dtype)), cudaMemcpyDeviceToDevice,
                              stream_));
      return;
    }
    if (dst.dtype != DType::kF32 && src.dtype != DType::kF32)
      throw std::invalid_argument(std::string("convert: ") + to_string(src.dtype) + " to " + to_string(dst.dtype) +
                                  " (one side must be fp32)");
    auto* d16 = static_cast<uint16_t*>(dst.data);
    auto* s16 = static_cast<const uint16_t*>(src.data);
    if (dst.dtype == DType::kBF16) to_lowp_kernel<1><<<blocks_for(n), kThreads, 0, stream_>>>(d16, f(src.data), n);
    else if (dst.dtype == DType::kF16) to_lowp_kernel<2><<<blocks_for(n), kThreads, 0, stream_>>>(d16, f(src.data), n);
    else if (src.dtype == DType::kBF16) from_lowp_kernel<1><<<blocks_for(n), kThreads, 0, stream_>>>(fm(dst.data), s16, n);
    else from_lowp_kernel<2><<<blocks_for(n), kThreads, 0, stream_>>>(fm(dst.data), s16, n);
    DS_LAUNCHED();
  }

  void gemm(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha,
            float beta) override {
    const EventOpTimes::Scope op_scope(times_, "gemm");
    gemm(C, ConstView{A, DType::kF32}, ConstView{B, DType::kF32}, M, N, K, ta, tb, alpha, beta);
  }
  void gemm_grouped(float* const* C, const float* const* A, const float* const* B, const int64_t* M, const int64_t* N,
                    const int64_t* K, int64_t count, bool ta, bool tb, float alpha, float beta) override {
    const EventOpTimes::Scope op_scope(times_, "gemm_grouped");
    if (grouped_call(C, reinterpret_cast<const void* const*>(A), reinterpret_cast<const void* const*>(B), DType::kF32,
                     M, N, K, count, ta, tb, alpha, beta))
      return;
    for (int64_t i = 0; i < count; ++i) gemm(C[i], A[i], B[i], M[i], N[i], K[i], ta, tb, alpha, beta);
  }
  void gemm_grouped(float* const* C, const void* const* A, const void* const* B, DType dtype, const int64_t* M,
                    const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb, float alpha,
                    float beta) override {
    const EventOpTimes::Scope op_scope(times_, "gemm_grouped");
    if (grouped_call(C, A, B, dtype, M, N, K, count, ta, tb, alpha, beta)) return;
    for (int64_t i = 0; i < count; ++i)
      gemm(C[i], ConstView{A[i], dtype}, ConstView{B[i], dtype}, M[i], N[i], K[i], ta, tb, alpha, beta);
  }
  // The experts' GEMMs as one cublasGemmGroupedBatchedEx call (one group per problem, fp32
  // output and accumulation): no per-shape cuBLASLt plan for row counts that change every step.
  // false, with nothing done: the caller runs them one by one — DSTRAIN_CUDA_GROUPED_GEMM=loop,
  // cuBLAS refused this type combination (a probe, once per type), or an operand is not 16-byte
  // aligned (cuBLAS's 16-bit kernels need it; the cuBLASLt path picks algorithms by alignment).
  bool grouped_call(float* const* C, const void* const* A, const void* const* B, DType dtype, const int64_t* M,
                    const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb, float alpha, float beta) {
    const char* choice = std::getenv("DSTRAIN_CUDA_GROUPED_GEMM");
    if (choice && std::string(choice) == "loop") return false;
    if (choice && std::string(choice) != "grouped")
      throw std::invalid_argument(std::string("DSTRAIN_CUDA_GROUPED_GEMM=") + choice + ": valid: grouped, loop");
    GroupArgs& g = group_;
    g.ta.clear(), g.tb.clear(), g.m.clear(), g.n.clear(), g.k.clear(), g.lda.clear(), g.ldb.clear(), g.ldc.clear();
    g.size.clear(), g.alpha.clear(), g.beta.clear(), g.ptrs.clear();
    std::vector<const void*> a_ptrs, b_ptrs, c_ptrs;
    std::vector<int64_t> empty;  // K = 0: C = beta C, after the call
    const int64_t es = dtype_size(dtype);
    for (int64_t i = 0; i < count; ++i) {
      if (M[i] == 0 || N[i] == 0) continue;
      if (K[i] == 0) {
        empty.push_back(i);
        continue;
      }
      if (M[i] > INT32_MAX || N[i] > INT32_MAX || K[i] > INT32_MAX) return false;
      // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T (as gemm).
      const int64_t lda = tb ? K[i] : N[i], ldb = ta ? M[i] : K[i], ldc = N[i];
      if (alignment_of(A[i]) < 16 || alignment_of(B[i]) < 16 || alignment_of(C[i]) < 16 || (lda * es) % 16 != 0 ||
          (ldb * es) % 16 != 0 || (ldc * 4) % 16 != 0)
        return false;
      g.ta.push_back(tb ? CUBLAS_OP_T : CUBLAS_OP_N), g.tb.push_back(ta ? CUBLAS_OP_T : CUBLAS_OP_N);
      g.m.push_back(int(N[i])), g.n.push_back(int(M[i])), g.k.push_back(int(K[i]));
      g.lda.push_back(int(lda)), g.ldb.push_back(int(ldb)), g.ldc.push_back(int(ldc));
      g.size.push_back(1), g.alpha.push_back(alpha), g.beta.push_back(beta);
      a_ptrs.push_back(B[i]), b_ptrs.push_back(A[i]), c_ptrs.push_back(C[i]);
    }
    const int groups = int(g.m.size());
    if (groups > 0) {
      if (!grouped_supported(dtype)) return false;
      g.ptrs.insert(g.ptrs.end(), a_ptrs.begin(), a_ptrs.end());
      g.ptrs.insert(g.ptrs.end(), b_ptrs.begin(), b_ptrs.end());
      g.ptrs.insert(g.ptrs.end(), c_ptrs.begin(), c_ptrs.end());
      DS_LT(grouped_launch(g, dtype, groups));
    }
    for (int64_t i : empty) {
      scale_kernel<<<blocks_for(M[i] * N[i]), kThreads, 0, stream_>>>(C[i], beta, M[i] * N[i]);
      DS_LAUNCHED();
    }
    return true;
  }
  // g's problems (their pointers in g.ptrs: A', B', C blocks) as one cuBLAS call on the stream.
  cublasStatus_t grouped_launch(const GroupArgs& g, DType dtype, int groups) {
    const int64_t bytes = int64_t(g.ptrs.size() * sizeof(void*));
    if (bytes > group_ptr_bytes_) {
      if (group_ptrs_) deallocate(group_ptrs_);
      group_ptrs_ = allocate(bytes);
      group_ptr_bytes_ = bytes;
    }
    // Ordered on the stream after the previous call's GEMMs read the array; from pageable
    // memory, so the host vector may change as soon as this returns.
    DS_CUDA(cudaMemcpyAsync(group_ptrs_, g.ptrs.data(), size_t(bytes), cudaMemcpyHostToDevice, stream_));
    const void* const* dev = static_cast<const void* const*>(group_ptrs_);
    const cudaDataType_t in = dtype == DType::kF32 ? CUDA_R_32F : dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
    return cublasGemmGroupedBatchedEx(blas_, g.ta.data(), g.tb.data(), g.m.data(), g.n.data(), g.k.data(),
                                      g.alpha.data(), dev, in, g.lda.data(), dev + groups, in, g.ldb.data(),
                                      g.beta.data(), const_cast<void* const*>(dev + 2 * groups), CUDA_R_32F,
                                      g.ldc.data(), groups, g.size.data(), CUBLAS_COMPUTE_32F);
  }
  // Whether cuBLAS runs grouped GEMMs with `dtype` inputs and fp32 output: one 16^3 probe per type
  // on scratch memory, the answer kept (a refusal is said once); live calls then must succeed.
  bool grouped_supported(DType dtype) {
    int& known = grouped_support_[int(dtype)];  // 0 unknown, 1 yes, -1 no
    if (known != 0) return known > 0;
    void* mem = allocate(3 * 16 * 16 * 4);
    GroupArgs p;
    p.ta = {CUBLAS_OP_N}, p.tb = {CUBLAS_OP_N}, p.m = {16}, p.n = {16}, p.k = {16}, p.lda = {16}, p.ldb = {16};
    p.ldc = {16}, p.size = {1}, p.alpha = {1.0f}, p.beta = {0.0f};
    char* base = static_cast<char*>(mem);
    p.ptrs = {base, base + 1024, base + 2048};
    const cublasStatus_t st = grouped_launch(p, dtype, 1);
    deallocate(mem);
    known = st == CUBLAS_STATUS_SUCCESS ? 1 : -1;
    if (known < 0)
      std::fprintf(stderr, "dstrain: cublasGemmGroupedBatchedEx refused %s inputs with fp32 output (status %d); "
                   "the experts' GEMMs run one by one\n", to_string(dtype), int(st));
    return known > 0;
  }
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt's first operand is
  // B and its second A, with m = N, n = M.
  void gemm(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha,
            float beta) override {
    const EventOpTimes::Scope op_scope(times_, "gemm");
    if (A.dtype != B.dtype)
      throw std::invalid_argument(std::string("gemm: inputs of two types, ") + to_string(A.dtype) + " and " +
                                  to_string(B.dtype));
    if (M == 0 || N == 0) return;
    if (K == 0) {
      scale_kernel<<<blocks_for(M * N), kThreads, 0, stream_>>>(C, beta, M * N);
      DS_LAUNCHED();
      return;
    }
    const GemmKey key{M, N, K, ta, tb, A.dtype, alignment_of(A.data), alignment_of(B.data), alignment_of(C)};
    const GemmPlan& plan = gemm_plan(key);
    DS_LT(cublasLtMatmul(lt_, plan.op, &alpha, B.data, plan.a, A.data, plan.b, &beta, C, plan.c, C, plan.c,
                         &plan.algo, workspace_, kWorkspaceBytes, stream_));
  }
  std::string lowp_gemm_implementation(DType dtype) override {
    return std::string("cuBLASLt ") + to_string(dtype) + " inputs, fp32 accumulation (" + device_name_ + ")";
  }
  bool low_precision_gemm_native(DType dtype) override { return dtype != DType::kF32; }

  void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                       float eps) override {
    const EventOpTimes::Scope op_scope(times_, "rmsnorm_forward");
    rmsnorm_forward(View{y, DType::kF32}, rstd, x, w, rows, C, eps);
  }
  void rmsnorm_forward(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                       float eps) override {
    const EventOpTimes::Scope op_scope(times_, "rmsnorm_forward");
    if (rows <= 0) return;
    with_storage(y, [&](auto kind, auto* p) {
      rmsnorm_forward_kernel<decltype(kind)::value><<<unsigned(rows), kThreads, 0, stream_>>>(p, rstd, x, w, C, eps);
    });
    DS_LAUNCHED();
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t C) override {
    const EventOpTimes::Scope op_scope(times_, "rmsnorm_backward");
    if (rows <= 0 || C <= 0) return;
    rmsnorm_backward_dx_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(dx, dy, x, w, rstd, C);
    DS_LAUNCHED();
    const int64_t chunks = (rows + kDwChunk - 1) / kDwChunk;
    if (chunks > 65535) throw std::invalid_argument("rmsnorm_backward: more than 65535 x 256 rows");
    float* partial = scratch(chunks * C);
    const dim3 grid(unsigned((C + kDwCols - 1) / kDwCols), unsigned(chunks)), block(kDwCols, kDwLanes);
    rmsnorm_dw_partial_kernel<<<grid, block, 0, stream_>>>(partial, dy, x, rstd, rows, C);
    DS_LAUNCHED();
    column_sums_add_kernel<<<blocks_for(C), kThreads, 0, stream_>>>(dw, partial, chunks, C);
    DS_LAUNCHED();
  }

  void rope_forward(float* out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                    const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                    bool interleave) override {
    const EventOpTimes::Scope op_scope(times_, "rope_forward");
    rope_forward(View{out, DType::kF32}, out_ts, out_hs, in, in_ts, in_hs, cos, sin, N, S, heads, dr, interleave);
  }
  void rope_forward(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                    const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                    bool interleave) override {
    const EventOpTimes::Scope op_scope(times_, "rope_forward");
    const int64_t n = N * heads * (dr / 2);
    if (n <= 0) return;
    with_storage(out, [&](auto kind, auto* p) {
      rope_forward_kernel<decltype(kind)::value><<<blocks_for(n), kThreads, 0, stream_>>>(
          p, out_ts, out_hs, in, in_ts, in_hs, cos, sin, N, S, heads, dr, interleave);
    });
    DS_LAUNCHED();
  }
  void rope_backward(float* din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                     const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                     bool interleave, bool accumulate) override {
    const EventOpTimes::Scope op_scope(times_, "rope_backward");
    rope_backward(View{din, DType::kF32}, in_ts, in_hs, dout, out_ts, out_hs, cos, sin, N, S, heads, dr, interleave,
                  accumulate);
  }
  void rope_backward(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                     const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                     bool interleave, bool accumulate) override {
    const EventOpTimes::Scope op_scope(times_, "rope_backward");
    const int64_t n = N * heads * (dr / 2);
    if (n <= 0) return;
    check_rope_backward(din.dtype, in_hs, heads, dr, accumulate);
    if (in_hs == 0) {  // one row for all heads (accumulating, so fp32: check_rope_backward)
      rope_backward_shared_kernel<<<blocks_for(N * (dr / 2)), kThreads, 0, stream_>>>(
          static_cast<float*>(din.data), in_ts, dout, out_ts, out_hs, cos, sin, N, S, heads, dr, interleave,
          accumulate);
      DS_LAUNCHED();
      return;
    }
    with_storage(din, [&](auto kind, auto* p) {
      rope_backward_kernel<decltype(kind)::value><<<blocks_for(n), kThreads, 0, stream_>>>(
          p, in_ts, in_hs, dout, out_ts, out_hs, cos, sin, N, S, heads, dr, interleave, accumulate);
    });
    DS_LAUNCHED();
  }

  void reserve_attention(int64_t S) override { attention_s_ = std::max(attention_s_, S); }
  void attention_forward(float* O, float* lse, const float* Q, const float* K, const float* V, int64_t B, int64_t S,
                         int64_t nh, int64_t dqk, int64_t dv, float scale) override {
    const EventOpTimes::Scope op_scope(times_, "attention_forward");
    attention_forward(O, lse, f32(Q), f32(K), f32(V), B, S, nh, dqk, dv, scale);
  }
  void attention_backward(float* dQ, float* dK, float* dV, const float* dO, const float* Q, const float* K,
                          const float* V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                          int64_t dqk, int64_t dv, float scale) override {
    const EventOpTimes::Scope op_scope(times_, "attention_backward");
    attention_backward(dQ, dK, dV, dO, f32(dO), f32(Q), f32(K), f32(V), O, lse, B, S, nh, dqk, dv, scale);
  }
  bool low_precision_attention(DType) const override { return true; }
  void attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                         int64_t nh, int64_t dqk, int64_t dv, float scale) override {
    const EventOpTimes::Scope op_scope(times_, "attention_forward");
    check_attention(Q, K, V, S, dqk, dv);
    const dev::AttnShape a{B, S, nh, dqk, dv, scale};
    const int64_t rows = B * nh * S;
    if (rows <= 0) return;
    if (Q.dtype != DType::kF32 && attention_choice() == AttentionChoice::kCudnn) {
      cudnn_attention_forward(O, lse, Q, K, V, B, S, nh, dqk, dv, scale);
      return;
    }
    if (tiled_attention(Q.dtype, B, nh, dqk, dv)) {
      const dim3 grid(unsigned((S + dev::kFlashRows - 1) / dev::kFlashRows), unsigned(nh), unsigned(B));
      const int64_t bytes = FlashFwdLayout(dqk, dv).bytes;
      if (Q.dtype == DType::kBF16)
        launch_tiled(attention_tiled_forward_kernel<1>, grid, bytes, O, lse, h(Q.data), h(K.data), h(V.data), a);
      else
        launch_tiled(attention_tiled_forward_kernel<2>, grid, bytes, O, lse, h(Q.data), h(K.data), h(V.data), a);
      return;
    }
    const int grid = int((rows + kAttnWarps - 1) / kAttnWarps);
    switch (Q.dtype) {
      case DType::kF32:
        attention_forward_kernel<0><<<grid, 32 * kAttnWarps, 0, stream_>>>(O, lse, f(Q.data), f(K.data), f(V.data), a);
        break;
      case DType::kBF16:
        attention_forward_kernel<1><<<grid, 32 * kAttnWarps, 0, stream_>>>(O, lse, h(Q.data), h(K.data), h(V.data), a);
        break;
      case DType::kF16:
        attention_forward_kernel<2><<<grid, 32 * kAttnWarps, 0, stream_>>>(O, lse, h(Q.data), h(K.data), h(V.data), a);
        break;
    }
    DS_LAUNCHED();
  }
  void attention_backward(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp, ConstView Q, ConstView K,
                          ConstView V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                          int64_t dqk, int64_t dv, float scale) override {
    const EventOpTimes::Scope op_scope(times_, "attention_backward");
    check_attention(Q, K, V, S, dqk, dv);
    if (dO_lp.dtype != Q.dtype)
      throw std::invalid_argument(std::string("attention_backward: dO in ") + to_string(dO_lp.dtype) +
                                  ", Q/K/V in " + to_string(Q.dtype));
    const dev::AttnShape a{B, S, nh, dqk, dv, scale};
    const int64_t rows = B * nh * S;
    if (rows <= 0) return;
    if (Q.dtype != DType::kF32 && attention_choice() == AttentionChoice::kCudnn) {
      cudnn_attention_backward(dQ, dK, dV, dO_lp, Q, K, V, O, lse, B, S, nh, dqk, dv, scale);
      return;
    }
    float* D = scratch(rows);
    const int grid = int((rows + kAttnWarps - 1) / kAttnWarps), threads = 32 * kAttnWarps;
    attention_rowsum_kernel<<<grid, threads, 0, stream_>>>(D, dO, O, a);
    DS_LAUNCHED();
    if (tiled_attention(Q.dtype, B, nh, dqk, dv)) {
      const dim3 tiles(unsigned((S + dev::kFlashRows - 1) / dev::kFlashRows), unsigned(nh), unsigned(B));
      const int64_t dq_bytes = FlashDqLayout(dqk, dv).bytes, dkv_bytes = FlashDkvLayout(dqk, dv).bytes;
      const uint16_t *g = h(dO_lp.data), *q = h(Q.data), *k = h(K.data), *v = h(V.data);
      if (Q.dtype == DType::kBF16) {
        launch_tiled(attention_tiled_dq_kernel<1>, tiles, dq_bytes, dQ, g, q, k, v, lse, static_cast<const float*>(D), a);
        launch_tiled(attention_tiled_dkv_kernel<1>, tiles, dkv_bytes, dK, dV, g, q, k, v, lse,
                     static_cast<const float*>(D), a);
      } else {
        launch_tiled(attention_tiled_dq_kernel<2>, tiles, dq_bytes, dQ, g, q, k, v, lse, static_cast<const float*>(D), a);
        launch_tiled(attention_tiled_dkv_kernel<2>, tiles, dkv_bytes, dK, dV, g, q, k, v, lse,
                     static_cast<const float*>(D), a);
      }
      return;
    }
    switch (Q.dtype) {
      case DType::kF32:
        attention_backward_dq_kernel<0><<<grid, threads, 0, stream_>>>(dQ, f(dO_lp.data), f(Q.data), f(K.data),
                                                                       f(V.data), lse, D, a);
        attention_backward_dkv_kernel<0><<<grid, threads, 0, stream_>>>(dK, dV, f(dO_lp.data), f(Q.data), f(K.data),
                                                                        f(V.data), lse, D, a);
        break;
      case DType::kBF16:
        attention_backward_dq_kernel<1><<<grid, threads, 0, stream_>>>(dQ, h(dO_lp.data), h(Q.data), h(K.data),
                                                                       h(V.data), lse, D, a);
        attention_backward_dkv_kernel<1><<<grid, threads, 0, stream_>>>(dK, dV, h(dO_lp.data), h(Q.data), h(K.data),
                                                                        h(V.data), lse, D, a);
        break;
      case DType::kF16:
        attention_backward_dq_kernel<2><<<grid, threads, 0, stream_>>>(dQ, h(dO_lp.data), h(Q.data), h(K.data),
                                                                       h(V.data), lse, D, a);
        attention_backward_dkv_kernel<2><<<grid, threads, 0, stream_>>>(dK, dV, h(dO_lp.data), h(Q.data), h(K.data),
                                                                        h(V.data), lse, D, a);
        break;
    }
    DS_LAUNCHED();
  }

  void swiglu_forward(float* M, const float* GU, int64_t N, int64_t I) override {
    const EventOpTimes::Scope op_scope(times_, "swiglu_forward");
    swiglu_forward(View{M, DType::kF32}, GU, N, I);
  }
  void swiglu_forward(View M, const float* GU, int64_t N, int64_t I) override {
    const EventOpTimes::Scope op_scope(times_, "swiglu_forward");
    if (N * I <= 0) return;
    const int blocks = blocks_for(N * I);
    with_storage(M, [&](auto kind, auto* p) {
      swiglu_forward_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, GU, N, I);
    });
    DS_LAUNCHED();
  }
  void swiglu_backward(float* dGU, const float* dM, const float* GU, int64_t N, int64_t I) override {
    const EventOpTimes::Scope op_scope(times_, "swiglu_backward");
    swiglu_backward(View{dGU, DType::kF32}, dM, GU, N, I);
  }
  void swiglu_backward(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) override {
    const EventOpTimes::Scope op_scope(times_, "swiglu_backward");
    if (N * I <= 0) return;
    const int blocks = blocks_for(N * I);
    with_storage(dGU, [&](auto kind, auto* p) {
      swiglu_backward_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, dM, GU, N, I);
    });
    DS_LAUNCHED();
  }

  void router_forward(int32_t* idx, float* w, float* scores, const float* logits, const float* bias, int64_t N,
                      const RouterParams& p) override {
    const EventOpTimes::Scope op_scope(times_, "router_forward");
    check_router(p);
    if (N <= 0) return;
    router_forward_kernel<<<blocks_for(N, 128), 128, 0, stream_>>>(idx, w, scores, logits, bias, N, p);
    DS_LAUNCHED();
  }
  void router_backward(float* dlogits, const float* dw, const float* dscores_extra, const float* scores,
                       const int32_t* idx, int64_t N, const RouterParams& p) override {
    const EventOpTimes::Scope op_scope(times_, "router_backward");
    check_router(p);
    if (N <= 0) return;
    router_backward_kernel<<<blocks_for(N, 128), 128, 0, stream_>>>(dlogits, dw, dscores_extra, scores, idx, N, p);
    DS_LAUNCHED();
  }

  // The plan with CUB: the slots' experts radix-sorted (stable) with the slot numbers as values,
  // then scattered into pos / src; counts by binary search in the sorted experts.
  void moe_plan(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k,
                int64_t E) override {
    const EventOpTimes::Scope op_scope(times_, "moe_plan");
    if (E <= 0) return;
    const int64_t n = N * k;
    if (n <= 0) {
      DS_CUDA(cudaMemsetAsync(counts, 0, size_t(E) * sizeof(int32_t), stream_));
      return;
    }
    if (n > int64_t(INT32_MAX)) throw std::invalid_argument("moe_plan: more than 2^31 rows");
    int end_bit = 1;
    while ((int64_t(1) << end_bit) < E) ++end_bit;
    const auto [sorted, sorted_slots] = sort_with_positions(idx, n, end_bit);
    plan_scatter_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(pos, src, sorted_slots, n, k);
    DS_LAUNCHED();
    plan_counts_kernel<<<blocks_for(E), kThreads, 0, stream_>>>(counts, sorted, n, E);
    DS_LAUNCHED();
  }
  void moe_balance_stats(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) override {
    const EventOpTimes::Scope op_scope(times_, "moe_balance_stats");
    if (b.groups * b.E <= 0) return;
    double* rowsum = reinterpret_cast<double*>(scratch(2 * std::max<int64_t>(b.n, 1)));
    if (b.n > 0) {
      balance_rowsum_kernel<<<blocks_for(b.n), kThreads, 0, stream_>>>(rowsum, scores, b.n, b.E);
      DS_LAUNCHED();
    }
    balance_stats_kernel<<<blocks_for(b.groups * b.E), kThreads, 0, stream_>>>(stats, idx, scores, rowsum, b);
    DS_LAUNCHED();
  }
  void moe_balance_grad(float* dscores, float* aux, const float* stats, const float* scores, const BalanceShape& b,
                        double weight, double grad_scale) override {
    const EventOpTimes::Scope op_scope(times_, "moe_balance_grad");
    if (aux) {
      balance_aux_kernel<<<1, 32, 0, stream_>>>(aux, stats, b, weight);
      DS_LAUNCHED();
    }
    if (b.n <= 0) return;
    balance_grad_kernel<<<blocks_for(b.n, 128), 128, 0, stream_>>>(dscores, stats, scores, b, weight, grad_scale);
    DS_LAUNCHED();
  }

  void gather_rows(float* out, const float* in, const int32_t* src, int64_t n, int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "gather_rows");
    gather_rows(View{out, DType::kF32}, in, src, n, H);
  }
  void gather_rows(View out, const float* in, const int32_t* src, int64_t n, int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "gather_rows");
    if (n * H <= 0) return;
    const int blocks = blocks_for(n * H);
    with_storage(out, [&](auto kind, auto* p) {
      gather_rows_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, in, src, n, H);
    });
    DS_LAUNCHED();
  }
  void moe_combine(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N, int64_t k,
                   int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "moe_combine");
    if (N * H <= 0) return;
    moe_combine_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(out, Y, w, pos, N, k, H);
    DS_LAUNCHED();
  }
  void moe_combine_backward(float* dY, float* dw, const float* dout, const float* Y, const float* w,
                            const int32_t* pos, int64_t N, int64_t k, int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "moe_combine_backward");
    moe_combine_backward(View{dY, DType::kF32}, dw, dout, Y, w, pos, N, k, H);
  }
  void moe_combine_backward(View dY, float* dw, const float* dout, const float* Y, const float* w,
                            const int32_t* pos, int64_t N, int64_t k, int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "moe_combine_backward");
    if (N * k <= 0) return;
    const int blocks = blocks_for(N * k * 32);
    with_storage(dY, [&](auto kind, auto* p) {
      moe_combine_backward_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, dw, dout, Y, w, pos, N, k, H);
    });
    DS_LAUNCHED();
  }
  void moe_dispatch_backward(float* dx, const float* dXp, const int32_t* pos, int64_t N, int64_t k,
                             int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "moe_dispatch_backward");
    if (N * H <= 0) return;
    moe_dispatch_backward_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(dx, dXp, pos, N, k, H);
    DS_LAUNCHED();
  }

  void cross_entropy(float* loss, float* logits, const int32_t* target, int64_t rows, int64_t V,
                     float grad_scale) override {
    const EventOpTimes::Scope op_scope(times_, "cross_entropy");
    if (rows <= 0) return;
    cross_entropy_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(loss, logits, target, V, grad_scale);
    DS_LAUNCHED();
  }
  void cross_entropy_row_max(float* row_max, const float* logits, int64_t rows, int64_t V) override {
    const EventOpTimes::Scope op_scope(times_, "cross_entropy_row_max");
    if (rows <= 0) return;
    ce_row_max_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(row_max, logits, V);
    DS_LAUNCHED();
  }
  void cross_entropy_row_sums(float* sums, const float* logits, const float* row_max, const int32_t* target,
                              int64_t v0, int64_t rows, int64_t V) override {
    const EventOpTimes::Scope op_scope(times_, "cross_entropy_row_sums");
    if (rows <= 0) return;
    ce_row_sums_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(sums, logits, row_max, target, v0, V);
    DS_LAUNCHED();
  }
  void cross_entropy_finish(float* loss, float* logits, const float* row_max, const float* sums,
                            const int32_t* target, int64_t v0, int64_t rows, int64_t V, float grad_scale) override {
    const EventOpTimes::Scope op_scope(times_, "cross_entropy_finish");
    if (rows <= 0) return;
    ce_finish_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(loss, logits, row_max, sums, target, v0, V, grad_scale);
    DS_LAUNCHED();
  }

  void embedding_forward(float* out, const float* table, const int32_t* ids, int64_t N, int64_t H) override {
    const EventOpTimes::Scope op_scope(times_, "embedding_forward");
    if (N * H <= 0) return;
    embedding_forward_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(out, table, ids, N, H);
    DS_LAUNCHED();
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t H,
                          int64_t) override {
    const EventOpTimes::Scope op_scope(times_, "embedding_backward");
    if (N * H <= 0) return;
    if (N > int64_t(INT32_MAX)) throw std::invalid_argument("embedding_backward: more than 2^31 tokens");
    // (all 32 bits: negative ids sort first)
    const auto [sorted_ids, sorted_tokens] = sort_with_positions(ids, N, 32);
    embedding_backward_runs_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(dtable, dout, sorted_ids,
                                                                               sorted_tokens, N, H);
    DS_LAUNCHED();
  }

  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) override {
    const EventOpTimes::Scope op_scope(times_, "adamw");
    if (n <= 0) return;
    adamw_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(param, grad, m, v, n, dev::adamw_consts(p));
    DS_LAUNCHED();
  }
  void adamw_round(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, View half,
                   float* widened) override {
    const EventOpTimes::Scope op_scope(times_, "adamw_round");
    if (n <= 0) return;
    auto* h = static_cast<uint16_t*>(half.data);
    if (half.dtype == DType::kBF16)
      adamw_round_kernel<1><<<blocks_for(n), kThreads, 0, stream_>>>(param, grad, m, v, n, dev::adamw_consts(p), h,
                                                                      widened);
    else if (half.dtype == DType::kF16)
      adamw_round_kernel<2><<<blocks_for(n), kThreads, 0, stream_>>>(param, grad, m, v, n, dev::adamw_consts(p), h,
                                                                      widened);
    else
      throw std::invalid_argument("adamw_round: the compute copy must be bf16 or fp16, not fp32");
    DS_LAUNCHED();
  }

  void add(float* y, const float* x, int64_t n) override {
    const EventOpTimes::Scope op_scope(times_, "add");
    if (n <= 0) return;
    add_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(y, x, n);
    DS_LAUNCHED();
  }
  void fill(float* y, float value, int64_t n) override {
    const EventOpTimes::Scope op_scope(times_, "fill");
    if (n <= 0) return;
    fill_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(y, value, n);
    DS_LAUNCHED();
  }
  void copy_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                    int64_t cols) override {
    const EventOpTimes::Scope op_scope(times_, "copy_strided");
    if (rows * cols <= 0) return;
    strided_kernel<false><<<blocks_for(rows * cols), kThreads, 0, stream_>>>(dst, dst_stride, src, src_stride, rows,
                                                                             cols);
    DS_LAUNCHED();
  }
  void copy_strided(View dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                    int64_t cols) override {
    const EventOpTimes::Scope op_scope(times_, "copy_strided");
    if (rows * cols <= 0) return;
    with_storage(dst, [&](auto kind, auto* p) {
      copy_strided_kernel<decltype(kind)::value><<<blocks_for(rows * cols), kThreads, 0, stream_>>>(
          p, dst_stride, src, src_stride, rows, cols);
    });
    DS_LAUNCHED();
  }
  void add_strided(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                   int64_t cols) override {
    const EventOpTimes::Scope op_scope(times_, "add_strided");
    if (rows * cols <= 0) return;
    strided_kernel<true><<<blocks_for(rows * cols), kThreads, 0, stream_>>>(dst, dst_stride, src, src_stride, rows,
                                                                            cols);
    DS_LAUNCHED();
  }

 private:
  static constexpr int64_t kWorkspaceBytes = 32ll << 20;  // cuBLASLt's, one for every GEMM
  static constexpr size_t kMaxPlans = 4096;                // GEMM shapes cached at most

  static const float* f(const void* p) { return static_cast<const float*>(p); }
  static float* fm(void* p) { return static_cast<float*>(p); }
  static const uint16_t* h(const void* p) { return static_cast<const uint16_t*>(p); }

  void check_attention(ConstView Q, ConstView K, ConstView V, int64_t S, int64_t dqk, int64_t dv) const {
    if (Q.dtype != K.dtype || Q.dtype != V.dtype)
      throw std::invalid_argument("attention: Q, K, V of different types");
    if (S > attention_s_)
      throw std::invalid_argument("attention on " + std::to_string(S) + " positions, but the backend reserved " +
                                  std::to_string(attention_s_) + " (call reserve_attention)");
    if (dqk > kMaxHeadDim || dv > kMaxHeadDim)
      throw std::invalid_argument("attention: head widths " + std::to_string(dqk) + " / " + std::to_string(dv) +
                                  " exceed the CUDA kernel's " + std::to_string(kMaxHeadDim));
  }
  static void check_router(const RouterParams& p) {
    if (p.num_experts > kMaxExperts || p.n_group > kMaxGroups)
      throw std::invalid_argument("router: " + std::to_string(p.num_experts) + " experts in " +
                                  std::to_string(p.n_group) + " groups exceed the CUDA kernel's " +
                                  std::to_string(kMaxExperts) + " / " + std::to_string(kMaxGroups));
  }

  // n int32 keys (bits [0, end_bit)) radix-sorted by CUB, stably, with their positions 0..n-1
  // as values: {sorted keys, sorted positions}, in the plan scratch (moe_plan's and the
  // embedding backward's; each uses it within one call, on the one stream). n < 2^31.
  std::pair<int32_t*, int32_t*> sort_with_positions(const int32_t* keys, int64_t n, int end_bit) {
    size_t temp = 0;
    DS_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, temp, keys, static_cast<int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(n), 0,
                                            end_bit, stream_));
    const int64_t bytes = 3 * n * 4 + int64_t(temp) + 256;
    if (bytes > plan_bytes_) {
      if (plan_buf_) deallocate(plan_buf_);
      plan_buf_ = allocate(bytes);
      plan_bytes_ = bytes;
    }
    int32_t* positions = static_cast<int32_t*>(plan_buf_);
    int32_t* sorted = positions + n;
    int32_t* sorted_positions = sorted + n;
    void* tmp = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(sorted_positions + n) + 255) / 256 * 256);
    iota_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(positions, n);
    DS_LAUNCHED();
    DS_CUDA(cub::DeviceRadixSort::SortPairs(tmp, temp, keys, sorted, positions, sorted_positions, int(n), 0, end_bit,
                                            stream_));
    return {sorted, sorted_positions};
  }

  // Backend-owned scratch for the attention row sums: grows to the largest request, then stays.
  // Whether 16-bit attention of these head sizes runs on the tensor-core tiles (else the rows
  // kernels): 16-bit storage, head sizes multiples of 16 (the MMA shape), compute capability 8+
  // (bf16 MMAs), the kernels' shared memory within the device's opt-in limit, and not
  // DSTRAIN_CUDA_ATTENTION=rows (read per call, so a check can run both).
  bool tiled_attention(DType dt, int64_t B, int64_t nh, int64_t dqk, int64_t dv) const {
    if (dt == DType::kF32 || dqk % 16 != 0 || dv % 16 != 0 || dqk > kMaxHeadDim || dv > kMaxHeadDim) return false;
    if (cc_major_ < 8 || B > 65535 || nh > 65535) return false;  // (grid y and z: heads, sequences)
    if (attention_choice() == AttentionChoice::kRows) return false;
    const int64_t most = std::max({FlashFwdLayout(dqk, dv).bytes, FlashDqLayout(dqk, dv).bytes,
                                   FlashDkvLayout(dqk, dv).bytes});
    return most <= smem_optin_;
  }
  // A tiled attention kernel with `bytes` of dynamic shared memory (raising the kernel's limit
  // past the default 48 KiB once per size).
  template <class... P, class... A>
  void launch_tiled(void (*kernel)(P...), dim3 grid, int64_t bytes, A... args) {
    int64_t& allowed = smem_allowed_[reinterpret_cast<const void*>(kernel)];
    if (bytes > allowed) {
      DS_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
      allowed = bytes;
    }
    kernel<<<grid, kFlashThreads, size_t(bytes), stream_>>>(args...);
    DS_LAUNCHED();
  }

  // ---- cuDNN's fused attention (DSTRAIN_CUDA_ATTENTION=cudnn, 16-bit inputs) ----------------------
  // The plugin (kernels/cuda/cudnn_attention.cpp) runs the graph on the compute stream; it writes
  // O and dQ / dK / dV in the inputs' type, so they land in 16-bit blocks of the pool and are
  // widened to the fp32 the interface returns; the backward reads O in 16 bits, re-rounded from
  // the fp32 one (the same bits cuDNN wrote). lse is cuDNN's softmax statistics as they are.

  // Pool blocks for one call, given back at its end (stream-ordered, so after the work using them).
  struct CallBlocks {
    CudaBackend& be;
    std::vector<void*> blocks;
    explicit CallBlocks(CudaBackend& b) : be(b) {}
    ~CallBlocks() {
      for (void* p : blocks) be.deallocate(p);
    }
    void* take(int64_t bytes) {
      blocks.push_back(be.allocate(bytes));
      return blocks.back();
    }
    // `p` where it is 16-byte aligned (the plans' tensors are), else an aligned copy: views may
    // sit at any 4-byte offset.
    const void* aligned(const void* p, int64_t bytes) {
      if (reinterpret_cast<uintptr_t>(p) % 16 == 0) return p;
      void* copy = take(bytes);
      DS_CUDA(cudaMemcpyAsync(copy, p, size_t(bytes), cudaMemcpyDeviceToDevice, be.stream_));
      return copy;
    }
  };

  // The plugin's context for this backend (a cuDNN handle on the compute stream, the plans built),
  // made on first use; an error names why cuDNN cannot be used.
  void* cudnn_context() {
    if (cudnn_) return cudnn_;
    const CudnnPlugin& p = cudnn_plugin();
    if (!p.open) throw std::runtime_error("DSTRAIN_CUDA_ATTENTION=cudnn: " + p.error);
    DS_CUDA(cudaSetDevice(device_));
    char error[1024] = {0};
    cudnn_ = p.open(stream_, error, sizeof error);
    if (!cudnn_) throw std::runtime_error(std::string("DSTRAIN_CUDA_ATTENTION=cudnn: ") + error);
    return cudnn_;
  }
  // Runs one problem with a workspace from the pool.
  void cudnn_run(const CudnnAttnProblem& problem, CudnnAttnBuffers& b, CallBlocks& blocks) {
    void* ctx = cudnn_context();
    const CudnnPlugin& p = cudnn_plugin();
    char error[1024] = {0};
    int64_t bytes = 0;
    if (p.prepare(ctx, &problem, &bytes, error, sizeof error) != 0)
      throw std::runtime_error(std::string("DSTRAIN_CUDA_ATTENTION=cudnn: ") + error);
    b.workspace = bytes > 0 ? blocks.take(bytes) : nullptr;
    b.workspace_bytes = bytes;
    if (p.run(ctx, &problem, &b, error, sizeof error) != 0)
      throw std::runtime_error(std::string("DSTRAIN_CUDA_ATTENTION=cudnn: ") + error);
  }
  static CudnnAttnProblem cudnn_problem(DType dt, int64_t B, int64_t S, int64_t nh, int64_t dqk, int64_t dv,
                                        float scale, bool backward) {
    CudnnAttnProblem p;
    p.B = B, p.S = S, p.nh = nh, p.dqk = dqk, p.dv = dv, p.scale = scale;
    p.dtype = dt == DType::kBF16 ? 1 : 2;
    p.backward = backward ? 1 : 0;
    return p;
  }
  void cudnn_attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                               int64_t nh, int64_t dqk, int64_t dv, float scale) {
    const int64_t nq = B * S * nh * dqk, nv = B * S * nh * dv, nl = B * nh * S;
    CallBlocks blocks(*this);
    CudnnAttnBuffers b;
    b.Q = blocks.aligned(Q.data, nq * 2), b.K = blocks.aligned(K.data, nq * 2), b.V = blocks.aligned(V.data, nv * 2);
    b.O = blocks.take(nv * 2);
    const bool lse_aligned = reinterpret_cast<uintptr_t>(lse) % 16 == 0;
    b.lse = lse_aligned ? lse : static_cast<float*>(blocks.take(nl * 4));
    cudnn_run(cudnn_problem(Q.dtype, B, S, nh, dqk, dv, scale, false), b, blocks);
    if (!lse_aligned) copy(lse, b.lse, nl * 4);
    convert(View{O, DType::kF32}, ConstView{b.O, Q.dtype}, nv);
  }
  void cudnn_attention_backward(float* dQ, float* dK, float* dV, ConstView dO, ConstView Q, ConstView K, ConstView V,
                                const float* O, const float* lse, int64_t B, int64_t S, int64_t nh, int64_t dqk,
                                int64_t dv, float scale) {
    const int64_t nq = B * S * nh * dqk, nv = B * S * nh * dv, nl = B * nh * S;
    CallBlocks blocks(*this);
    CudnnAttnBuffers b;
    b.Q = blocks.aligned(Q.data, nq * 2), b.K = blocks.aligned(K.data, nq * 2), b.V = blocks.aligned(V.data, nv * 2);
    b.dO = blocks.aligned(dO.data, nv * 2);
    b.lse_in = static_cast<const float*>(blocks.aligned(lse, nl * 4));
    void* o16 = blocks.take(nv * 2);
    convert(View{o16, Q.dtype}, f32(O), nv);  // the forward's 16-bit O again (fp32 holds it exactly)
    b.O_in = o16;
    b.dQ = blocks.take(nq * 2), b.dK = blocks.take(nq * 2), b.dV = blocks.take(nv * 2);
    cudnn_run(cudnn_problem(Q.dtype, B, S, nh, dqk, dv, scale, true), b, blocks);
    convert(View{dQ, DType::kF32}, ConstView{b.dQ, Q.dtype}, nq);
    convert(View{dK, DType::kF32}, ConstView{b.dK, Q.dtype}, nq);
    convert(View{dV, DType::kF32}, ConstView{b.dV, Q.dtype}, nv);
  }

  float* scratch(int64_t floats) {
    if (floats > scratch_floats_) {
      if (scratch_) deallocate(scratch_);
      scratch_ = static_cast<float*>(allocate(floats * 4));
      scratch_floats_ = floats;
    }
    return scratch_;
  }

  void destroy(GemmPlan& plan) {
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
    if (plan.op) cublasLtMatmulDescDestroy(plan.op);
    plan = GemmPlan{};
  }

  const GemmPlan& gemm_plan(const GemmKey& k) {
    auto it = plans_.find(k);
    if (it != plans_.end()) return it->second;
    // The experts' row counts change every step: keep the cache bounded (descriptors are host
    // objects that cuBLASLt reads at the call, so dropping them all here is safe).
    if (plans_.size() >= kMaxPlans) {
      for (auto& [key, plan] : plans_) destroy(plan);
      plans_.clear();
    }
    GemmPlan p;
    const cudaDataType_t in = cuda_type(k.dtype);
    DS_LT(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    DS_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    DS_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    // cuBLASLt's A is our B: [K,N] row-major = [N,K] column-major (ld N), or transposed.
    if (k.tb) DS_LT(cublasLtMatrixLayoutCreate(&p.a, in, uint64_t(k.K), uint64_t(k.N), k.K));
    else DS_LT(cublasLtMatrixLayoutCreate(&p.a, in, uint64_t(k.N), uint64_t(k.K), k.N));
    if (k.ta) DS_LT(cublasLtMatrixLayoutCreate(&p.b, in, uint64_t(k.M), uint64_t(k.K), k.M));
    else DS_LT(cublasLtMatrixLayoutCreate(&p.b, in, uint64_t(k.K), uint64_t(k.M), k.K));
    DS_LT(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, uint64_t(k.N), uint64_t(k.M), k.N));
    cublasLtMatmulPreference_t pref;
    DS_LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kWorkspaceBytes;
    DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k.al_b,
                                               sizeof(k.al_b)));
    DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k.al_a,
                                               sizeof(k.al_a)));
    DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k.al_c,
                                               sizeof(k.al_c)));
    DS_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k.al_c,
                                               sizeof(k.al_c)));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
      destroy(p);
      throw std::runtime_error("cuBLASLt has no algorithm for a " + std::string(to_string(k.dtype)) + " GEMM " +
                               std::to_string(k.M) + "x" + std::to_string(k.N) + "x" + std::to_string(k.K) +
                               " (status " + std::to_string(int(st)) + ")");
    }
    p.algo = result.algo;
    return plans_.emplace(k, p).first->second;
  }

  int device_ = 0;
  std::string device_name_;
  int sms_ = 0;
  int cc_major_ = 0;
  void* plan_buf_ = nullptr;  // moe_plan's slots, sorted keys and values, CUB's temporary storage
  int64_t plan_bytes_ = 0;
  int64_t smem_optin_ = 0;  // bytes of shared memory a block may opt into
  std::map<const void*, int64_t> smem_allowed_;  // per tiled attention kernel: the limit set
  cudaStream_t stream_ = nullptr;
  EventOpTimes times_;  // monitor.op_breakdown
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;  // the grouped GEMMs (cublasGemmGroupedBatchedEx)
  void* group_ptrs_ = nullptr;     // their A, B, C pointer arrays on the device
  int64_t group_ptr_bytes_ = 0;
  int grouped_support_[3] = {0, 0, 0};  // per input type: 0 not probed, 1 supported, -1 refused
  GroupArgs group_;
  void* workspace_ = nullptr;
  double* partials_ = nullptr;  // sum_squares' per-block sums
  std::map<GemmKey, GemmPlan> plans_;
  int64_t attention_s_ = 0;
  void* cudnn_ = nullptr;  // the cuDNN plugin's context (cudnn_context)
  float* scratch_ = nullptr;
  int64_t scratch_floats_ = 0;

  std::mutex mu_;
  struct Block {
    void* p = nullptr;
    int64_t size = 0;
    std::vector<std::shared_ptr<StreamUse>> uses;  // work on other streams that touched it
  };
  // Whether a cached block may be handed out now: every recorded use finished, or the compute
  // stream made to wait for it (false while one is not launched yet: its group is still open).
  bool ordered_after_uses(Block& b) {
    for (auto& u : b.uses)
      if (!u->finished() && !u->order_before(stream_)) return false;
    b.uses.clear();
    return true;
  }
  // The device is full: every cached block goes back to CUDA — once what uses it has finished
  // (the compute stream ordered after it, then synchronised); blocks of groups not launched yet
  // stay cached.
  void release_cache() {
    for (auto& [s, b] : free_) (void)ordered_after_uses(b);
    DS_CUDA(cudaStreamSynchronize(stream_));
    for (auto it = free_.begin(); it != free_.end();) {
      if (!it->second.uses.empty()) {
        ++it;
        continue;
      }
      cudaFree(it->second.p);
      cached_ -= it->first;
      it = free_.erase(it);
    }
  }
  bool poison_ = [] {
    const char* v = std::getenv("DSTRAIN_CUDA_POISON");
    return v && std::string(v) == "1";
  }();
  std::multimap<int64_t, Block> free_;
  std::map<void*, Block> used_;
  int64_t mallocs_ = 0, in_use_ = 0, peak_ = 0, cached_ = 0;
};

}  // namespace

// The plugin's entry points (kernels/cuda/cuda_loader.cpp finds them with dlsym). The structs
// cross the boundary by pointer: the plugin and its loader are built together, from one header.
extern "C" __attribute__((visibility("default"))) int dstrain_cuda_plugin_abi() { return kCudaPluginAbi; }

extern "C" __attribute__((visibility("default"))) void dstrain_cuda_device_info(int device, CudaDeviceInfo* info) {
  *info = CudaDeviceInfo{};
  cudaError_t e = cudaGetDeviceCount(&info->count);
  cudaRuntimeGetVersion(&info->runtime_version);
  cudaDriverGetVersion(&info->driver_version);
  info->cublaslt_version = int64_t(cublasLtGetVersion());
  if (e != cudaSuccess) {
    info->count = 0;
    info->error = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    cudaGetLastError();
    return;
  }
  if (info->count == 0) {
    info->error = "no CUDA device";
    return;
  }
  if (device < 0 || device >= info->count) {
    info->error = "device " + std::to_string(device) + " of " + std::to_string(info->count);
    return;
  }
  cudaDeviceProp prop{};
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    info->error = cudaGetErrorString(e);
    return;
  }
  info->name = prop.name;
  info->memory_bytes = int64_t(prop.totalGlobalMem);
  info->cc_major = prop.major;
  info->cc_minor = prop.minor;
  info->multiprocessors = prop.multiProcessorCount;
}

// Returns null and fills `error` when the backend cannot be made.
extern "C" __attribute__((visibility("default"))) Backend* dstrain_cuda_make_backend(int device, std::string* error) {
  try {
    return new CudaBackend(device);
  } catch (const std::exception& e) {
    *error = e.what();
    return nullptr;
  }
}

extern "C" __attribute__((visibility("default"))) void dstrain_cuda_range_push(const char* name) {
  nvtxRangePushA(name);
}
extern "C" __attribute__((visibility("default"))) void dstrain_cuda_range_pop() { nvtxRangePop(); }

extern "C" __attribute__((visibility("default"))) bool dstrain_cuda_pool_stats(Backend* be, CudaPoolStats* out) {
  auto* c = dynamic_cast<CudaBackend*>(be);
  if (!c) return false;
  *out = c->pool_stats();
  return true;
}

}  // namespace dstrain::kernels
