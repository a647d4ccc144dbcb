// The CUDA backend's row and element-wise ops (docs/design.md §6.11; the class:
// kernels/cuda/cuda_backend.cuh): RMSNorm, RoPE, SwiGLU, the fp32 <-> bf16 / fp16 conversions,
// strided copies and adds, fill and add. Their per-element math is dstrain/kernels/row_math.h's
// (shared with the CPU backend, through device_math.h); an op whose
// output is a typed View writes fp32, bf16 or fp16, rounded as convert() rounds.
//
// Deterministic by construction: RMSNorm's rows are one block each with a fixed-order block
// reduction, and its weight gradient is two passes over fixed chunks of rows; RoPE's backward
// into a row every head shares (MLA's rope key) adds the heads in order in one thread.
#include <stdexcept>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

namespace {

// ---- Element-wise and conversions --------------------------------------------------------------

__global__ void fill_kernel(float* y, float v, int64_t n) {
  GRID_STRIDE(i, n) y[i] = v;
}
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  GRID_STRIDE(i, n) y[i] += x[i];
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

// ---- RMSNorm -----------------------------------------------------------------------------------

template <int KIND>  // y in fp32 / bf16 / fp16 (rounded as convert() rounds)
__global__ void rmsnorm_forward_kernel(dev::Storage<KIND>* y, float* rstd, const float* x, const float* w, int64_t C,
                                       float eps) {
  const int64_t r = blockIdx.x;
  const float* xr = x + r * C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += xr[c] * xr[c];
  ss = block_reduce<false>(ss);
  const float rs = math::rms_scale(ss, C, eps);
  if (threadIdx.x == 0) rstd[r] = rs;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    y[r * C + c] = dev::store_as<KIND>(math::rmsnorm_out(w[c], xr[c], rs));
}
__global__ void rmsnorm_backward_dx_kernel(float* dx, const float* dy, const float* x, const float* w,
                                           const float* rstd, int64_t C) {
  const int64_t r = blockIdx.x;
  const float rs = rstd[r];
  const float *xr = x + r * C, *dyr = dy + r * C;
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += math::rmsnorm_dot_term(dyr[c], w[c], xr[c], rs);
  dot = block_reduce<false>(dot) / float(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dx[r * C + c] = math::rmsnorm_dx(dyr[c], w[c], xr[c], rs, dot);
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
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kDwLanes)
      acc += math::rmsnorm_dw_term(dy[r * C + c], x[r * C + c], rstd[r]);
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

// ---- SwiGLU ------------------------------------------------------------------------------------

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

}  // namespace

void CudaBackend::convert_impl(View dst, ConstView src, int64_t n) {
  const EventOpTimes::Scope op_scope(times_, "convert");
  if (n <= 0) return;
  if (dst.dtype == src.dtype) {
    DS_CUDA(cudaMemcpyAsync(dst.data, src.data, size_t(n * dtype_size(src.dtype)), cudaMemcpyDeviceToDevice,
                            stream_));
    return;
  }
  auto* d16 = static_cast<uint16_t*>(dst.data);
  auto* s16 = static_cast<const uint16_t*>(src.data);
  if (dst.dtype == DType::kBF16) to_lowp_kernel<1><<<blocks_for(n), kThreads, 0, stream_>>>(d16, f(src.data), n);
  else if (dst.dtype == DType::kF16) to_lowp_kernel<2><<<blocks_for(n), kThreads, 0, stream_>>>(d16, f(src.data), n);
  else if (src.dtype == DType::kBF16) from_lowp_kernel<1><<<blocks_for(n), kThreads, 0, stream_>>>(fm(dst.data), s16, n);
  else from_lowp_kernel<2><<<blocks_for(n), kThreads, 0, stream_>>>(fm(dst.data), s16, n);
  DS_LAUNCHED();
}

void CudaBackend::rmsnorm_forward_impl(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                                       float eps) {
  const EventOpTimes::Scope op_scope(times_, "rmsnorm_forward");
  if (rows <= 0) return;
  with_storage(y, [&](auto kind, auto* p) {
    rmsnorm_forward_kernel<decltype(kind)::value><<<unsigned(rows), kThreads, 0, stream_>>>(p, rstd, x, w, C, eps);
  });
  DS_LAUNCHED();
}
void CudaBackend::rmsnorm_backward_impl(float* dx, float* dw, const float* dy, const float* x, const float* w,
                                   const float* rstd, int64_t rows, int64_t C) {
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

void CudaBackend::rope_forward_impl(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts,
                               int64_t in_hs, const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads,
                               int64_t dr, bool interleave) {
  const EventOpTimes::Scope op_scope(times_, "rope_forward");
  const int64_t n = N * heads * (dr / 2);
  if (n <= 0) return;
  with_storage(out, [&](auto kind, auto* p) {
    rope_forward_kernel<decltype(kind)::value><<<blocks_for(n), kThreads, 0, stream_>>>(
        p, out_ts, out_hs, in, in_ts, in_hs, cos, sin, N, S, heads, dr, interleave);
  });
  DS_LAUNCHED();
}
void CudaBackend::rope_backward_impl(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts,
                                int64_t out_hs, const float* cos, const float* sin, int64_t N, int64_t S,
                                int64_t heads, int64_t dr, bool interleave, bool accumulate) {
  const EventOpTimes::Scope op_scope(times_, "rope_backward");
  const int64_t n = N * heads * (dr / 2);
  if (n <= 0) return;
  if (in_hs == 0) {  // one row for all heads (accumulating, so fp32: Backend::rope_backward checked)
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

void CudaBackend::swiglu_forward_impl(View M, const float* GU, int64_t N, int64_t I) {
  const EventOpTimes::Scope op_scope(times_, "swiglu_forward");
  if (N * I <= 0) return;
  const int blocks = blocks_for(N * I);
  with_storage(M, [&](auto kind, auto* p) {
    swiglu_forward_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, GU, N, I);
  });
  DS_LAUNCHED();
}
void CudaBackend::swiglu_backward_impl(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) {
  const EventOpTimes::Scope op_scope(times_, "swiglu_backward");
  if (N * I <= 0) return;
  const int blocks = blocks_for(N * I);
  with_storage(dGU, [&](auto kind, auto* p) {
    swiglu_backward_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, dM, GU, N, I);
  });
  DS_LAUNCHED();
}

void CudaBackend::add_impl(float* y, const float* x, int64_t n) {
  const EventOpTimes::Scope op_scope(times_, "add");
  if (n <= 0) return;
  add_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(y, x, n);
  DS_LAUNCHED();
}
void CudaBackend::fill_impl(float* y, float value, int64_t n) {
  const EventOpTimes::Scope op_scope(times_, "fill");
  if (n <= 0) return;
  fill_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(y, value, n);
  DS_LAUNCHED();
}
void CudaBackend::copy_strided_impl(View dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                               int64_t cols) {
  const EventOpTimes::Scope op_scope(times_, "copy_strided");
  if (rows * cols <= 0) return;
  with_storage(dst, [&](auto kind, auto* p) {
    copy_strided_kernel<decltype(kind)::value><<<blocks_for(rows * cols), kThreads, 0, stream_>>>(
        p, dst_stride, src, src_stride, rows, cols);
  });
  DS_LAUNCHED();
}
void CudaBackend::add_strided_impl(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                              int64_t cols) {
  const EventOpTimes::Scope op_scope(times_, "add_strided");
  if (rows * cols <= 0) return;
  strided_kernel<true><<<blocks_for(rows * cols), kThreads, 0, stream_>>>(dst, dst_stride, src, src_stride, rows,
                                                                          cols);
  DS_LAUNCHED();
}

}  // namespace cuda_impl
}  // namespace dstrain::kernels
