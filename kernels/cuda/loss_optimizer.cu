// The CUDA backend's loss, embedding and optimizer ops (docs/design.md §6.11; the class:
// kernels/cuda/cuda_backend.cuh): cross-entropy (whole rows, and the vocabulary-parallel pieces:
// row maxima, row sums, finish), the embedding and its table gradient, AdamW (fp32, and mixed
// precision's update that also rounds the compute copy), and the sum of squares in double (the
// gradient norm).
//
// Deterministic by construction: cross-entropy's rows are one block each with a fixed-order
// block reduction; the table gradient sorts the token ids (CUB's stable radix sort, moe.cu's
// sort_with_positions) and the thread at the start of each run of equal ids adds the run's rows
// in token order, the CPU's order; the sum of squares is two passes over a fixed grid
// (kSumBlocks, cuda_backend.cuh).
#include <climits>
#include <stdexcept>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

namespace {

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
  const float lse = math::log_sum_exp(mx, sum), ly = l[y];
  __syncthreads();  // every thread has read l[y] before it is overwritten
  if (threadIdx.x == 0) loss[r] = lse - ly;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    l[v] = math::ce_grad_target(math::ce_grad(l[v], lse, gs, dev::DeviceExp{}), v == y ? gs : 0.0f);
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
  const float lse = math::log_sum_exp(row_max[r], sums[2 * r]);
  if (threadIdx.x == 0) loss[r] = lse - sums[2 * r + 1];
  const int64_t y = int64_t(target[r]) - v0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
    l[v] = math::ce_grad_target(math::ce_grad(l[v], lse, gs, dev::DeviceExp{}), v == y ? gs : 0.0f);
}

// ---- Embedding ---------------------------------------------------------------------------------

template <int KIND>
__global__ void embedding_forward_kernel(float* out, const dev::Storage<KIND>* table, const int32_t* ids, int64_t N,
                                         int64_t H) {
  GRID_STRIDE(x, N * H) {
    const int32_t id = ids[x / H];
    out[x] = id < 0 ? 0.0f : dev::load<KIND>(table, int64_t(id) * H + x % H);
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

// ---- AdamW -------------------------------------------------------------------------------------

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

}  // namespace

void CudaBackend::cross_entropy_impl(float* loss, float* logits, const int32_t* target, int64_t rows, int64_t V,
                                float grad_scale) {
  const EventOpTimes::Scope op_scope(times_, "cross_entropy");
  if (rows <= 0) return;
  cross_entropy_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(loss, logits, target, V, grad_scale);
  DS_LAUNCHED();
}
void CudaBackend::cross_entropy_row_max_impl(float* row_max, const float* logits, int64_t rows, int64_t V) {
  const EventOpTimes::Scope op_scope(times_, "cross_entropy_row_max");
  if (rows <= 0) return;
  ce_row_max_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(row_max, logits, V);
  DS_LAUNCHED();
}
void CudaBackend::cross_entropy_row_sums_impl(float* sums, const float* logits, const float* row_max, const int32_t* target,
                                         int64_t v0, int64_t rows, int64_t V) {
  const EventOpTimes::Scope op_scope(times_, "cross_entropy_row_sums");
  if (rows <= 0) return;
  ce_row_sums_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(sums, logits, row_max, target, v0, V);
  DS_LAUNCHED();
}
void CudaBackend::cross_entropy_finish_impl(float* loss, float* logits, const float* row_max, const float* sums,
                                       const int32_t* target, int64_t v0, int64_t rows, int64_t V, float grad_scale) {
  const EventOpTimes::Scope op_scope(times_, "cross_entropy_finish");
  if (rows <= 0) return;
  ce_finish_kernel<<<unsigned(rows), kThreads, 0, stream_>>>(loss, logits, row_max, sums, target, v0, V, grad_scale);
  DS_LAUNCHED();
}

void CudaBackend::embedding_forward_impl(float* out, ConstView table, const int32_t* ids, int64_t N, int64_t H) {
  const EventOpTimes::Scope op_scope(times_, "embedding_forward");
  if (N * H <= 0) return;
  const auto* t16 = static_cast<const uint16_t*>(table.data);
  if (table.dtype == DType::kF32)
    embedding_forward_kernel<0><<<blocks_for(N * H), kThreads, 0, stream_>>>(out, f(table.data), ids, N, H);
  else if (table.dtype == DType::kBF16)
    embedding_forward_kernel<1><<<blocks_for(N * H), kThreads, 0, stream_>>>(out, t16, ids, N, H);
  else
    embedding_forward_kernel<2><<<blocks_for(N * H), kThreads, 0, stream_>>>(out, t16, ids, N, H);
  DS_LAUNCHED();
}
void CudaBackend::embedding_backward_impl(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t H,
                                     int64_t) {
  const EventOpTimes::Scope op_scope(times_, "embedding_backward");
  if (N * H <= 0) return;
  if (N > int64_t(INT32_MAX)) throw std::invalid_argument("embedding_backward: more than 2^31 tokens");
  // (all 32 bits: negative ids sort first)
  const auto [sorted_ids, sorted_tokens] = sort_with_positions(ids, N, 32);
  embedding_backward_runs_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(dtable, dout, sorted_ids,
                                                                             sorted_tokens, N, H);
  DS_LAUNCHED();
}

void CudaBackend::adamw_impl(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
                             View half, float* widened) {
  if (!half.data) {  // adamw
    const EventOpTimes::Scope op_scope(times_, "adamw");
    if (n <= 0) return;
    adamw_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(param, grad, m, v, n, dev::adamw_consts(p));
    DS_LAUNCHED();
    return;
  }
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

// Two passes with a fixed grid (the same partial sums, in the same order, every time).
void CudaBackend::sum_squares_impl(double* out, const float* x, int64_t n, bool accumulate) {
  const EventOpTimes::Scope op_scope(times_, "sum_squares");
  sum_squares_partial_kernel<<<kSumBlocks, kThreads, 0, stream_>>>(partials_, x, n);
  sum_squares_final_kernel<<<1, kThreads, 0, stream_>>>(out, partials_, accumulate);
  DS_LAUNCHED();
}

}  // namespace cuda_impl
}  // namespace dstrain::kernels
