// The CUDA backend's mixture-of-experts ops (docs/design.md §6.11; the class:
// kernels/cuda/cuda_backend.cuh): the router (selection and weights, and its backward; a
// token's row is dstrain/kernels/row_math.h's, shared with the CPU), the dispatch plan made on
// the device (the slots' experts sorted stably by CUB's radix sort), the balance loss's
// statistics and gradient, and the data movement — gather into the experts' rows, combine back
// with the weights, their backwards.
// sort_with_positions also serves the embedding's backward (loss_optimizer.cu).
//
// Deterministic by construction: every sum has one thread (or warp) adding in a fixed order —
// combine and dispatch backward over a token's k choices, the balance statistics over a group's
// tokens; combine backward is a warp per (token, choice).
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

namespace {

// ---- Router ------------------------------------------------------------------------------------

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

}  // namespace

void CudaBackend::router_forward_impl(int32_t* idx, float* w, float* scores, const float* logits, const float* bias,
                                 int64_t N, const RouterParams& p) {
  const EventOpTimes::Scope op_scope(times_, "router_forward");
  check_router(p);
  if (N <= 0) return;
  router_forward_kernel<<<blocks_for(N, 128), 128, 0, stream_>>>(idx, w, scores, logits, bias, N, p);
  DS_LAUNCHED();
}
void CudaBackend::router_backward_impl(float* dlogits, const float* dw, const float* dscores_extra, const float* scores,
                                  const int32_t* idx, int64_t N, const RouterParams& p) {
  const EventOpTimes::Scope op_scope(times_, "router_backward");
  check_router(p);
  if (N <= 0) return;
  router_backward_kernel<<<blocks_for(N, 128), 128, 0, stream_>>>(dlogits, dw, dscores_extra, scores, idx, N, p);
  DS_LAUNCHED();
}

// The plan with CUB: the slots' experts radix-sorted (stable) with the slot numbers as values,
// then scattered into pos / src; counts by binary search in the sorted experts.
void CudaBackend::moe_plan_impl(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k,
                           int64_t E) {
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
void CudaBackend::moe_balance_stats_impl(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) {
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
void CudaBackend::moe_balance_grad_impl(float* dscores, float* aux, const float* stats, const float* scores,
                                   const BalanceShape& b, double weight, double grad_scale) {
  const EventOpTimes::Scope op_scope(times_, "moe_balance_grad");
  if (aux) {
    balance_aux_kernel<<<1, 32, 0, stream_>>>(aux, stats, b, weight);
    DS_LAUNCHED();
  }
  if (b.n <= 0) return;
  balance_grad_kernel<<<blocks_for(b.n, 128), 128, 0, stream_>>>(dscores, stats, scores, b, weight, grad_scale);
  DS_LAUNCHED();
}

void CudaBackend::gather_rows_impl(View out, const float* in, const int32_t* src, int64_t n, int64_t H) {
  const EventOpTimes::Scope op_scope(times_, "gather_rows");
  if (n * H <= 0) return;
  const int blocks = blocks_for(n * H);
  with_storage(out, [&](auto kind, auto* p) {
    gather_rows_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, in, src, n, H);
  });
  DS_LAUNCHED();
}
void CudaBackend::moe_combine_impl(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N,
                                   int64_t k, int64_t H) {
  if (!w) {  // moe_dispatch_backward
    const EventOpTimes::Scope op_scope(times_, "moe_dispatch_backward");
    if (N * H <= 0) return;
    moe_dispatch_backward_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(out, Y, pos, N, k, H);
    DS_LAUNCHED();
    return;
  }
  const EventOpTimes::Scope op_scope(times_, "moe_combine");
  if (N * H <= 0) return;
  moe_combine_kernel<<<blocks_for(N * H), kThreads, 0, stream_>>>(out, Y, w, pos, N, k, H);
  DS_LAUNCHED();
}
void CudaBackend::moe_combine_backward_impl(View dY, float* dw, const float* dout, const float* Y, const float* w,
                                       const int32_t* pos, int64_t N, int64_t k, int64_t H) {
  const EventOpTimes::Scope op_scope(times_, "moe_combine_backward");
  if (N * k <= 0) return;
  const int blocks = blocks_for(N * k * 32);
  with_storage(dY, [&](auto kind, auto* p) {
    moe_combine_backward_kernel<decltype(kind)::value><<<blocks, kThreads, 0, stream_>>>(p, dw, dout, Y, w, pos, N, k, H);
  });
  DS_LAUNCHED();
}

void CudaBackend::check_router(const RouterParams& p) {
  if (p.num_experts > kMaxExperts || p.n_group > kMaxGroups)
    throw std::invalid_argument("router: " + std::to_string(p.num_experts) + " experts in " +
                                std::to_string(p.n_group) + " groups exceed the CUDA kernel's " +
                                std::to_string(kMaxExperts) + " / " + std::to_string(kMaxGroups));
}

// n int32 keys (bits [0, end_bit)) radix-sorted by CUB, stably, with their positions 0..n-1
// as values: {sorted keys, sorted positions}, in the plan scratch (moe_plan's and the
// embedding backward's; each uses it within one call, on the one stream). n < 2^31.
std::pair<int32_t*, int32_t*> CudaBackend::sort_with_positions(const int32_t* keys, int64_t n, int end_bit) {
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

}  // namespace cuda_impl
}  // namespace dstrain::kernels
