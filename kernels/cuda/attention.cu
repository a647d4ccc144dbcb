// The CUDA backend's causal attention (docs/design.md §6.11; the class:
// kernels/cuda/cuda_backend.cuh): the checks, the choice among the three implementations, and
// the rows kernels. The 16-bit tensor-core tiles are attention_tiles.cu, cuDNN's fused attention
// cudnn_dispatch.cu. Every implementation follows the CPU's 16-bit kernel: the forward finds the
// row's log-sum-exp L first, then sum_j p_ij V_j with p_ij = exp(s_ij - L) rounded to the
// storage type; the backward computes D = rowsum(dO o O) in fp32, then dQ by query and dK, dV by
// key in separate kernels, so no output is summed by two blocks (no atomics, the same bits on
// every run).
//
// The rows kernels: a warp per row on CUDA cores, for fp32 (tensor cores would round it to
// TF32), head sizes not multiples of 16, older GPUs, and kernels.cuda_attention rows; their math
// is device_math.h's attention rows.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

// The kernel options (KernelOptions): the attention — the tensor-core tiles where they apply
// (`tiled`), the rows kernels (`rows`), or cuDNN's fused attention for bf16 / fp16 inputs
// (`cudnn`; fp32 inputs run the rows kernels whatever the choice) — the experts' grouped GEMM
// (`grouped` or `loop`) and the pool's poisoning; checked here, once.
void CudaBackend::set_options_impl(const KernelOptions& o) {
  AttentionChoice a = AttentionChoice::kTiled;
  if (o.cuda_attention == "rows") a = AttentionChoice::kRows;
  else if (o.cuda_attention == "cudnn") a = AttentionChoice::kCudnn;
  else if (o.cuda_attention != "tiled")
    throw std::invalid_argument("kernels.cuda_attention " + o.cuda_attention +
                                ": valid: tiled, rows, cudnn (cudnn: cuDNN's fused attention for bf16 / fp16 inputs; "
                                "fp32 inputs run the rows kernels whatever the choice)");
  if (o.cuda_grouped_gemm != "grouped" && o.cuda_grouped_gemm != "loop")
    throw std::invalid_argument("kernels.cuda_grouped_gemm " + o.cuda_grouped_gemm + ": valid: grouped, loop");
  std::lock_guard<std::mutex> lock(mu_);
  attention_ = a;
  poison_ = o.cuda_poison;
}

namespace {

// ---- One warp per row --------------------------------------------------------------------------

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

}  // namespace

// ---- The ops -----------------------------------------------------------------------------------

void CudaBackend::reserve_attention_impl(int64_t S) { attention_s_ = std::max(attention_s_, S); }
void CudaBackend::attention_forward_impl(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B,
                                         int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale) {
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
    tiled_attention_forward(O, lse, Q, K, V, a);
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
    default:  // the wrappers pass only fp32 / bf16 / fp16
      break;
  }
  DS_LAUNCHED();
}
void CudaBackend::attention_backward_impl(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp,
                                          ConstView Q, ConstView K, ConstView V, const float* O, const float* lse,
                                          int64_t B, int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale) {
  const EventOpTimes::Scope op_scope(times_, "attention_backward");
  check_attention(Q, K, V, S, dqk, dv);
  if (dO_lp.dtype != Q.dtype)
    throw std::invalid_argument(std::string("attention_backward: dO in ") + to_string(dO_lp.dtype) + ", Q/K/V in " +
                                to_string(Q.dtype));
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
    tiled_attention_backward(dQ, dK, dV, dO_lp, Q, K, V, lse, D, a);
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
    default:  // the wrappers pass only fp32 / bf16 / fp16
      break;
  }
  DS_LAUNCHED();
}

void CudaBackend::check_attention(ConstView Q, ConstView K, ConstView V, int64_t S, int64_t dqk, int64_t dv) const {
  if (Q.dtype != K.dtype || Q.dtype != V.dtype)
    throw std::invalid_argument("attention: Q, K, V of different types");
  if (S > attention_s_)
    throw std::invalid_argument("attention on " + std::to_string(S) + " positions, but the backend reserved " +
                                std::to_string(attention_s_) + " (call reserve_attention)");
  if (dqk > kMaxHeadDim || dv > kMaxHeadDim)
    throw std::invalid_argument("attention: head widths " + std::to_string(dqk) + " / " + std::to_string(dv) +
                                " exceed the CUDA kernel's " + std::to_string(kMaxHeadDim));
}

}  // namespace cuda_impl
}  // namespace dstrain::kernels
