// The CUDA backend's private header (docs/design.md §6.11), compiled by nvcc only: the error
// checks, launch helpers and block reductions its kernels share, the per-op CUDA-event timing
// (EventOpTimes) and the class CudaBackend, whose methods are defined by op family — each file
// with its own kernels, since a kernel is launched from the file that defines it (no
// relocatable device code):
//   cuda_backend.cu     construction, the caching memory pool, the compute stream and the
//                       copies, per-op timing, the plugin's C entry points
//   gemm.cu             GEMMs: cuBLASLt plans cached per shape, the experts' grouped GEMMs
//   attention.cu        attention's checks and choice of kernels, the rows kernels (fp32)
//   attention_tiles.cu  the 16-bit tensor-core tiles
//   cudnn_dispatch.cu   the cuDNN attention plugin's loader and the calls into it
//   norm_activation.cu  RMSNorm, RoPE, SwiGLU, conversions, copies, element-wise ops
//   moe.cu              router, dispatch plan (CUB's sort), gather / combine, balance loss
//   loss_optimizer.cu   cross-entropy, embedding, AdamW, the sum of squares
// One compute stream per backend: every op is a kernel launch or a cuBLAS(Lt) call ordered on
// it, so the host never waits except in copy_to_host / copy_from_host / synchronize. The
// per-element and per-row math is dstrain/kernels/row_math.h (shared with the CPU backend) and
// kernels/cuda/device_math.h, both compiled by the host tests too.
// Deterministic by construction: no atomics; every reduction adds in a fixed order, so the same
// inputs give the same bits on every run.
//
// Everything here is in namespace cuda_impl, hidden: libdstrain_cuda.so exports only the C
// entry points of cuda_backend.cu.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/cuda.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/device_math.h"

namespace dstrain::kernels {
namespace cuda_impl __attribute__((visibility("hidden"))) {

inline void cuda_ok(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
                             ") in " + what + " at " + file + ":" + std::to_string(line));
}
inline void lt_ok(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error("cuBLASLt status " + std::to_string(int(s)) + " in " + what + " at " + file + ":" +
                             std::to_string(line));
}
#define DS_CUDA(x) cuda_ok((x), #x, __FILE__, __LINE__)
#define DS_LT(x) lt_ok((x), #x, __FILE__, __LINE__)
// A launch's configuration errors surface at the next call; check right after it.
#define DS_LAUNCHED() DS_CUDA(cudaGetLastError())

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 256;   // attention's dqk and dv (device_math.h MAXD)
constexpr int kMaxExperts = 256;   // the router's bit masks (device_math.h MAXE)
constexpr int kMaxGroups = 64;     // its group scores (MAXG)
// sum_squares' grid (loss_optimizer.cu), part of the result's definition: the same n (and
// alignment) gives the same bits. 8 blocks per H200 multiprocessor, each thread reading 16 bytes
// at a time: enough loads in flight to stream at HBM bandwidth (264 blocks of scalar loads, the
// first version, kept about a tenth of that in flight by Little's law: some 20-50 ms for the
// 4.6G gradients of the h200 preset).
constexpr int kSumBlocks = 1056;

inline int blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(std::min<int64_t>(std::max<int64_t>(b, 1), 1 << 20));
}

// f(kind, p) with kind = std::integral_constant<int, KIND> for the View's storage type (KIND 0 /
// 1 / 2: fp32 / bf16 / fp16) and p its data as Storage<KIND>*: the launch of a kernel templated on
// its output type, written once.
template <class F>
void with_storage(View v, F&& f) {
  switch (v.dtype) {
    case DType::kF32: return f(std::integral_constant<int, 0>{}, static_cast<float*>(v.data));
    case DType::kBF16: return f(std::integral_constant<int, 1>{}, static_cast<uint16_t*>(v.data));
    case DType::kF16: return f(std::integral_constant<int, 2>{}, static_cast<uint16_t*>(v.data));
    default:
      return;  // the wrappers pass only fp32 / bf16 / fp16
  }
}

// ---- Reductions (device) -----------------------------------------------------------------------

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

#define GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// ---- GEMM plans and grouped calls (gemm.cu) ----------------------------------------------------

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

// One grouped GEMM call's arguments for cublasGemmGroupedBatchedEx (host arrays, one group per
// problem; the pointers go to the device in one copy).
struct GroupArgs {
  std::vector<cublasOperation_t> ta, tb;
  std::vector<int> m, n, k, lda, ldb, ldc, size;
  std::vector<float> alpha, beta;
  std::vector<const void*> ptrs;  // A' (our B), B' (our A), C: one block each
};

// ---- Per-op timing (defined in cuda_backend.cu) ------------------------------------------------

// monitor.op_breakdown on the GPU (Backend::set_op_timing): a pair of CUDA events recorded on the
// stream around each op, read back by take() once the stream has finished. As on the CPU
// (dstrain/kernels/op_times.h), a Scope counts only when no other is open, so an op built of
// other ops counts once, under its own name. Off, a Scope costs one relaxed load.
class EventOpTimes {
 public:
  cudaStream_t stream = nullptr;  // the backend's
  ~EventOpTimes();
  void set(bool on) { on_.store(on, std::memory_order_relaxed); }

  // The device time per op of the ops timed since the last call, largest first (waits for them).
  std::vector<OpTime> take();

  class Scope {
   public:
    // Never throws, neither here nor at the end: timing that cannot be done (an event not
    // created or recorded) leaves the op untimed, never the op or the run failed.
    Scope(EventOpTimes& t, const char* op) noexcept {
      if (!t.on_.load(std::memory_order_relaxed)) return;
      open_ = &t.open_;
      if (open_->fetch_add(1) > 0) return;  // inside another op: that one counts
      t_ = &t;
      op_ = op;
      start_ = t.event();
      started_ = start_ && cudaEventRecord(start_, t.stream) == cudaSuccess;
    }
    ~Scope() {
      if (!open_) return;
      if (t_) {
        const cudaEvent_t end = started_ ? t_->event() : nullptr;
        if (end && cudaEventRecord(end, t_->stream) == cudaSuccess) t_->add(op_, start_, end);
        else t_->give_back(start_, end);
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
    bool started_ = false;
  };

 private:
  struct Record {
    const char* op;  // (the ops' names are literals)
    cudaEvent_t start, end;
  };
  // An event from the pool or a new one; nullptr where none can be made. All three never throw.
  cudaEvent_t event() noexcept;
  void add(const char* op, cudaEvent_t start, cudaEvent_t end) noexcept;
  void give_back(cudaEvent_t a, cudaEvent_t b) noexcept;
  std::atomic<bool> on_{false};
  std::atomic<int> open_{0};
  std::mutex mu_;
  std::vector<Record> records_;
  std::vector<cudaEvent_t> pool_;
};

// ---- The backend -------------------------------------------------------------------------------

// KernelOptions::cuda_attention (attention.cu).
enum class AttentionChoice { kTiled, kRows, kCudnn };

class CudaBackend final : public Backend {
 public:
  // cuda_backend.cu: the device, the pool, the stream, copies, op timing.
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  AttentionChoice attention_choice() const { return attention_; }
  void* allocate(int64_t bytes) override;
  void deallocate(void* p) override;
  void record_use(const void* p, std::shared_ptr<StreamUse> use) override;
  CudaPoolStats pool_stats();
  bool is_device_memory(const void* p) const override;

 protected:
  // The ops (Backend's *_impl: called by its wrappers, which have checked the calls).
  void set_options_impl(const KernelOptions& options) override;  // attention.cu
  void set_op_timing_impl(bool on) override;
  std::vector<OpTime> take_op_times_impl() override;
  void copy_impl(void* dst, const void* src, int64_t bytes, CopyKind kind) override;
  int64_t device_memory_free_impl() override;
  void synchronize_impl() override;

  // gemm.cu
  void gemm_impl(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha,
                 float beta) override;
  void gemm_grouped_impl(float* const* C, const void* const* A, const void* const* B, DType dtype, const int64_t* M,
                         const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb, float alpha,
                         float beta) override;
  LowPrecisionSupport low_precision_impl(DType dtype, bool describe) override;

  // attention.cu (the tiles: attention_tiles.cu; cuDNN: cudnn_dispatch.cu)
  void reserve_attention_impl(int64_t S) override;
  void attention_forward_impl(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                              int64_t nh, int64_t dqk, int64_t dv, float scale) override;
  void attention_backward_impl(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp, ConstView Q,
                               ConstView K, ConstView V, const float* O, const float* lse, int64_t B, int64_t S,
                               int64_t nh, int64_t dqk, int64_t dv, float scale) override;

  // norm_activation.cu
  void convert_impl(View dst, ConstView src, int64_t n) override;
  void rmsnorm_forward_impl(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                            float eps) override;
  void rmsnorm_backward_impl(float* dx, float* dw, const float* dy, const float* x, const float* w, const float* rstd,
                             int64_t rows, int64_t C) override;
  void rope_forward_impl(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                         const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                         bool interleave) override;
  void rope_backward_impl(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                          const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                          bool interleave, bool accumulate) override;
  void swiglu_forward_impl(View M, const float* GU, int64_t N, int64_t I) override;
  void swiglu_backward_impl(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) override;
  void add_impl(float* y, const float* x, int64_t n) override;
  void fill_impl(float* y, float value, int64_t n) override;
  void copy_strided_impl(View dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                         int64_t cols) override;
  void add_strided_impl(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                        int64_t cols) override;

  // moe.cu
  void router_forward_impl(int32_t* idx, float* w, float* scores, const float* logits, const float* bias, int64_t N,
                           const RouterParams& p) override;
  void router_backward_impl(float* dlogits, const float* dw, const float* dscores_extra, const float* scores,
                            const int32_t* idx, int64_t N, const RouterParams& p) override;
  void moe_plan_impl(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k,
                     int64_t E) override;
  void moe_balance_stats_impl(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) override;
  void moe_balance_grad_impl(float* dscores, float* aux, const float* stats, const float* scores,
                             const BalanceShape& b, double weight, double grad_scale) override;
  void gather_rows_impl(View out, const float* in, const int32_t* src, int64_t n, int64_t H) override;
  void moe_combine_impl(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N, int64_t k,
                        int64_t H) override;
  void moe_combine_backward_impl(View dY, float* dw, const float* dout, const float* Y, const float* w,
                                 const int32_t* pos, int64_t N, int64_t k, int64_t H) override;

  // loss_optimizer.cu
  void cross_entropy_impl(float* loss, float* logits, const int32_t* target, int64_t rows, int64_t V,
                          float grad_scale) override;
  void cross_entropy_row_max_impl(float* row_max, const float* logits, int64_t rows, int64_t V) override;
  void cross_entropy_row_sums_impl(float* sums, const float* logits, const float* row_max, const int32_t* target,
                                   int64_t v0, int64_t rows, int64_t V) override;
  void cross_entropy_finish_impl(float* loss, float* logits, const float* row_max, const float* sums,
                                 const int32_t* target, int64_t v0, int64_t rows, int64_t V,
                                 float grad_scale) override;
  void embedding_forward_impl(float* out, ConstView table, const int32_t* ids, int64_t N, int64_t H) override;
  void embedding_backward_impl(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t H,
                               int64_t) override;
  void adamw_impl(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, View half,
                  float* widened) override;
  void sum_squares_impl(double* out, const float* x, int64_t n, bool accumulate) override;

 private:
  static constexpr int64_t kWorkspaceBytes = 32ll << 20;  // cuBLASLt's, one for every GEMM
  static constexpr size_t kMaxPlans = 4096;                // GEMM shapes cached at most

  std::string describe() const;  // the name: device, driver, runtime, cuBLASLt
  static const float* f(const void* p) { return static_cast<const float*>(p); }
  static float* fm(void* p) { return static_cast<float*>(p); }
  static const uint16_t* h(const void* p) { return static_cast<const uint16_t*>(p); }

  // cuda_backend.cu: backend-owned scratch (grows to the largest request, then stays) and the
  // pool's ordering across streams.
  float* scratch(int64_t floats);
  struct Block {
    void* p = nullptr;
    int64_t size = 0;
    std::vector<std::shared_ptr<StreamUse>> uses;  // work on other streams that touched it
  };
  bool ordered_after_uses(Block& b);
  void release_cache();

  // gemm.cu
  bool grouped_call(float* const* C, const void* const* A, const void* const* B, DType dtype, const int64_t* M,
                    const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb, float alpha, float beta);
  cublasStatus_t grouped_launch(const GroupArgs& g, DType dtype, int groups);
  bool grouped_supported(DType dtype);
  void destroy(GemmPlan& plan);
  const GemmPlan& gemm_plan(const GemmKey& k);

  // attention.cu, attention_tiles.cu
  void check_attention(ConstView Q, ConstView K, ConstView V, int64_t S, int64_t dqk, int64_t dv) const;
  bool tiled_attention(DType dt, int64_t B, int64_t nh, int64_t dqk, int64_t dv) const;
  void tiled_attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, const dev::AttnShape& a);
  void tiled_attention_backward(float* dQ, float* dK, float* dV, ConstView dO_lp, ConstView Q, ConstView K,
                                ConstView V, const float* lse, const float* D, const dev::AttnShape& a);
  template <class... P, class... A>
  void launch_tiled(void (*kernel)(P...), dim3 grid, int64_t bytes, A... args);

  // cudnn_dispatch.cu
  struct CallBlocks;
  void* cudnn_context();
  void cudnn_close();
  void cudnn_run(const CudnnAttnProblem& problem, CudnnAttnBuffers& b, CallBlocks& blocks);
  static CudnnAttnProblem cudnn_problem(DType dt, int64_t B, int64_t S, int64_t nh, int64_t dqk, int64_t dv,
                                        float scale, bool backward);
  void cudnn_attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                               int64_t nh, int64_t dqk, int64_t dv, float scale);
  void cudnn_attention_backward(float* dQ, float* dK, float* dV, ConstView dO, ConstView Q, ConstView K, ConstView V,
                                const float* O, const float* lse, int64_t B, int64_t S, int64_t nh, int64_t dqk,
                                int64_t dv, float scale);

  // moe.cu
  static void check_router(const RouterParams& p);
  std::pair<int32_t*, int32_t*> sort_with_positions(const int32_t* keys, int64_t n, int end_bit);

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

  // The pool (cuda_backend.cu).
  std::mutex mu_;
  bool poison_ = false;  // KernelOptions::cuda_poison
  AttentionChoice attention_ = AttentionChoice::kTiled;
  std::multimap<int64_t, Block> free_;
  std::map<void*, Block> used_;
  int64_t mallocs_ = 0, in_use_ = 0, peak_ = 0, cached_ = 0;
};

}  // namespace cuda_impl
}  // namespace dstrain::kernels
