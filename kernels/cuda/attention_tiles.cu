// The CUDA backend's 16-bit attention on tensor cores (docs/design.md §6.11; the class:
// kernels/cuda/cuda_backend.cuh; the checks, the choice of kernels and the rows kernels:
// attention.cu). bf16 / fp16, head sizes multiples of 16, compute capability 8+: a block of four
// warps owns 64 query rows (for dK / dV, 64 keys) and walks 64-wide tiles of keys (queries)
// staged in shared memory; each warp forms its 16 x 64 score tile with WMMA 16x16x16 MMAs (fp32
// accumulation), every lane turns 32 of its scores into 16-bit p or dS over the same shared
// bytes, and the next MMAs accumulate P V, dS K, P^T dO and dS^T Q into per-warp fp32 tiles in
// shared memory. The geometry, lane mapping, masking and rounding are device_math.h's "tiled"
// functions, which the host tests run block by block; a shape whose shared memory exceeds the
// device's opt-in limit takes the rows kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <map>

#include "kernels/cuda/cuda_backend.cuh"

namespace dstrain::kernels {
namespace cuda_impl {

namespace {

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
  const float L = math::log_sum_exp(m, l);
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

}  // namespace

// Whether 16-bit attention of these head sizes runs on the tensor-core tiles (else the rows
// kernels): 16-bit storage, head sizes multiples of 16 (the MMA shape), compute capability 8+
// (bf16 MMAs), the kernels' shared memory within the device's opt-in limit, and not
// kernels.cuda_attention rows (read per call, so a check can run both).
bool CudaBackend::tiled_attention(DType dt, int64_t B, int64_t nh, int64_t dqk, int64_t dv) const {
  if (dt == DType::kF32 || dqk % 16 != 0 || dv % 16 != 0 || dqk > kMaxHeadDim || dv > kMaxHeadDim) return false;
  if (cc_major_ < 8 || B > 65535 || nh > 65535) return false;  // (grid y and z: heads, sequences)
  if (attention_choice() == AttentionChoice::kRows) return false;
  const int64_t most =
      std::max({FlashFwdLayout(dqk, dv).bytes, FlashDqLayout(dqk, dv).bytes, FlashDkvLayout(dqk, dv).bytes});
  return most <= smem_optin_;
}

// A tiled attention kernel with `bytes` of dynamic shared memory (raising the kernel's limit
// past the default 48 KiB once per size).
template <class... P, class... A>
void CudaBackend::launch_tiled(void (*kernel)(P...), dim3 grid, int64_t bytes, A... args) {
  int64_t& allowed = smem_allowed_[reinterpret_cast<const void*>(kernel)];
  if (bytes > allowed) {
    DS_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    allowed = bytes;
  }
  kernel<<<grid, kFlashThreads, size_t(bytes), stream_>>>(args...);
  DS_LAUNCHED();
}

// The forward: grid (query blocks, heads, sequences).
void CudaBackend::tiled_attention_forward(float* O, float* lse, ConstView Q, ConstView K, ConstView V,
                                          const dev::AttnShape& a) {
  const dim3 grid(unsigned((a.S + dev::kFlashRows - 1) / dev::kFlashRows), unsigned(a.nh), unsigned(a.B));
  const int64_t bytes = FlashFwdLayout(a.dqk, a.dv).bytes;
  if (Q.dtype == DType::kBF16)
    launch_tiled(attention_tiled_forward_kernel<1>, grid, bytes, O, lse, h(Q.data), h(K.data), h(V.data), a);
  else
    launch_tiled(attention_tiled_forward_kernel<2>, grid, bytes, O, lse, h(Q.data), h(K.data), h(V.data), a);
}

// The backward after the row sums D (attention.cu): dQ by query block, then dK and dV by key block.
void CudaBackend::tiled_attention_backward(float* dQ, float* dK, float* dV, ConstView dO_lp, ConstView Q, ConstView K,
                                           ConstView V, const float* lse, const float* D, const dev::AttnShape& a) {
  const dim3 tiles(unsigned((a.S + dev::kFlashRows - 1) / dev::kFlashRows), unsigned(a.nh), unsigned(a.B));
  const int64_t dq_bytes = FlashDqLayout(a.dqk, a.dv).bytes, dkv_bytes = FlashDkvLayout(a.dqk, a.dv).bytes;
  const uint16_t *g = h(dO_lp.data), *q = h(Q.data), *k = h(K.data), *v = h(V.data);
  if (Q.dtype == DType::kBF16) {
    launch_tiled(attention_tiled_dq_kernel<1>, tiles, dq_bytes, dQ, g, q, k, v, lse, D, a);
    launch_tiled(attention_tiled_dkv_kernel<1>, tiles, dkv_bytes, dK, dV, g, q, k, v, lse, D, a);
  } else {
    launch_tiled(attention_tiled_dq_kernel<2>, tiles, dq_bytes, dQ, g, q, k, v, lse, D, a);
    launch_tiled(attention_tiled_dkv_kernel<2>, tiles, dkv_bytes, dK, dV, g, q, k, v, lse, D, a);
  }
}

}  // namespace cuda_impl
}  // namespace dstrain::kernels
