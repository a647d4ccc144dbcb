// CPU kernels as templates over the element type: the backend instantiates them for float,
// the tests also for double (finite-difference gradient checks). Their per-element formulas are
// dstrain/kernels/row_math.h's, which the CUDA kernels evaluate too; here are the row walks. Threaded with OpenMP over
// rows, tokens or (sequence, head) pairs; the inner loops are written so the compiler
// vectorises them. No op allocates: the attention kernels take their scratch from the caller
// (attention_workspace_floats).
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/blas_gemm.h"

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/row_math.h"

namespace dstrain::kernels::cpu {

// exp that the compiler vectorises (a libm call per element does not): Cephes' expf — range
// reduction by ln 2 split in two constants, a degree-6 polynomial, 2^n by exponent bits; about
// 1 ulp from expf on [-87, 88] (inputs are clamped there; NaN propagates). Rounding uses the
// 1.5 * 2^23 trick and clamping plain compares, which GCC vectorises (std::floor and std::fmin
// it does not, under the default trapping-math rules). Double keeps std::exp (the
// finite-difference tests run in double).
inline float vexp(float x) {
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.0f ? -87.0f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  return y * std::bit_cast<float>((int32_t(n) + 127) << 23);
}
inline double vexp(double x) { return std::exp(x); }
// vexp as the `exp` of the shared row math (dstrain/kernels/row_math.h).
struct VExp {
  template <class T>
  T operator()(T x) const {
    return vexp(x);
  }
};

// ---- RMSNorm -------------------------------------------------------------------------------

// One row (the 16-bit-output op reuses it, so its values are these bit for bit).
template <class T>
inline void rmsnorm_row(T* yr, T* rstd_r, const T* xr, const T* w, int64_t C, T eps) {
  T ss = 0;
  for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
  const T rs = math::rms_scale(ss, C, eps);
  *rstd_r = rs;
  for (int64_t c = 0; c < C; ++c) yr[c] = math::rmsnorm_out(w[c], xr[c], rs);
}
template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int64_t rows, int64_t C, T eps) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rmsnorm_row(y + r * C, rstd + r, x + r * C, w, C, eps);
}

template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd,
                      int64_t rows, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * C;
    const T* dyr = dy + r * C;
    T* dxr = dx + r * C;
    const T rs = rstd[r];
    T dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += math::rmsnorm_dot_term(dyr[c], w[c], xr[c], rs);
    dot /= T(C);
    for (int64_t c = 0; c < C; ++c) dxr[c] = math::rmsnorm_dx(dyr[c], w[c], xr[c], rs, dot);
  }
  // dw: column blocks per thread, rows inside (no two threads touch the same dw element).
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
    T acc[kBlock] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const T rs = rstd[r];
      const T* xr = x + r * C;
      const T* dyr = dy + r * C;
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += math::rmsnorm_dw_term(dyr[c], xr[c], rs);
    }
    for (int64_t c = c0; c < c1; ++c) dw[c] += acc[c - c0];
  }
}

// ---- RoPE (docs/model.md §3.4.1) ----------------------------------------------------------------

// One token's and head's dr-vector x rotated into o (de-interleaved), and its transpose: the
// input gradient dx of output gradient g, added to dx or written over it. Shared by the ops below
// and the typed-output forms of the CPU backend (the same code, so the same bits).
template <class T>
inline void rope_forward_row(T* o, const T* x, const T* c, const T* s, int64_t half, bool interleave) {
  for (int64_t j = 0; j < half; ++j)
    math::rope_rotate(x[math::rope_first(j, 2 * half, interleave)], x[math::rope_second(j, 2 * half, interleave)], c[j],
                      s[j], &o[j], &o[j + half]);
}
template <class T>
inline void rope_backward_row(T* dx, const T* g, const T* c, const T* s, int64_t half, bool interleave,
                              bool accumulate) {
  for (int64_t j = 0; j < half; ++j) {
    T da, db;
    math::rope_rotate_back(g[j], g[j + half], c[j], s[j], &da, &db);
    T& xa = dx[math::rope_first(j, 2 * half, interleave)];
    T& xb = dx[math::rope_second(j, 2 * half, interleave)];
    xa = accumulate ? xa + da : da;
    xb = accumulate ? xb + db : db;
  }
}

template <class T>
void rope_forward(T* out, int64_t out_ts, int64_t out_hs, const T* in, int64_t in_ts,
                  int64_t in_hs, const T* cos, const T* sin, int64_t N, int64_t S, int64_t heads,
                  int64_t dr, bool interleave) {
  const int64_t half = dr / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rope_forward_row(out + t * out_ts + h * out_hs, in + t * in_ts + h * in_hs, cos + (t % S) * half,
                       sin + (t % S) * half, half, interleave);
}

template <class T>
void rope_backward(T* din, int64_t in_ts, int64_t in_hs, const T* dout, int64_t out_ts,
                   int64_t out_hs, const T* cos, const T* sin, int64_t N, int64_t S, int64_t heads,
                   int64_t dr, bool interleave, bool accumulate) {
  const int64_t half = dr / 2;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rope_backward_row(din + t * in_ts + h * in_hs, dout + t * out_ts + h * out_hs, cos + (t % S) * half,
                        sin + (t % S) * half, half, interleave, accumulate);
}

// ---- Causal attention ------------------------------------------------------------------------
// Per (sequence, head), queries in tiles of kTile: scores of one tile against the keys it may
// see (GEMM), masked softmax in place, then P V (GEMM). Only a kTile x S block of scores exists
// at a time per thread; backward recomputes it from the saved log-sum-exp.

constexpr int64_t kAttnTile = 64;

// Scratch of the attention kernels for sequences of up to S positions on `threads` threads: a
// score block and its gradient, kAttnTile x S each, per thread.
inline int64_t attention_workspace_floats(int64_t S, int threads) { return int64_t(threads) * 2 * kAttnTile * S; }

// Thread t's block of an attention workspace (the parallel regions run on at most ws_threads).
template <class T>
T* attention_block(T* ws, int64_t S) {
  return ws + int64_t(omp_get_thread_num()) * 2 * kAttnTile * S;
}

// The largest of x[0, n), n >= 1. GCC leaves a float max reduction scalar (its NaN rules), so
// AVX-512 where the translation unit is built for it (the kernels are; the result is the same
// either way: a maximum is exact).
inline float row_max(const float* x, int64_t n) {
  int64_t j = 0;
  float m = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 v = _mm512_loadu_ps(x);
    for (j = 16; j + 16 <= n; j += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + j));
    m = _mm512_reduce_max_ps(v);
  }
#endif
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}
inline double row_max(const double* x, int64_t n) {
  double m = x[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// One query row of a score tile in place: its first `visible` scores become the causal softmax,
// the rest of the row's `keys` zero; returns the row's log-sum-exp.
template <class T>
T causal_softmax_row(T* p, int64_t visible, int64_t keys) {
  const T m = row_max(p, visible);
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < visible; ++j) sum += (p[j] = vexp(p[j] - m));
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < visible; ++j) p[j] *= inv;
  for (int64_t j = visible; j < keys; ++j) p[j] = 0;
  return math::log_sum_exp(m, sum);
}

// Backward of one row: from the scaled scores p and dP = dO V^T in dp, the probabilities
// p = exp(p - L) and dS = p (dp - D) scale (scaled for dQ and dK) in place, zero past `visible`.
template <class T>
void causal_softmax_grad_row(T* p, T* dp, int64_t visible, int64_t keys, T L, T D, T scale) {
#pragma omp simd
  for (int64_t j = 0; j < visible; ++j) {
    p[j] = vexp(p[j] - L);
    dp[j] = math::softmax_grad(p[j], dp[j], D, scale);
  }
  for (int64_t j = visible; j < keys; ++j) p[j] = dp[j] = 0;
}

// ws: attention_workspace_floats(S, ws_threads) elements.
template <class T>
void attention_forward(T* O, T* lse, const T* Q, const T* K, const T* V, int64_t B, int64_t S,
                       int64_t nh, int64_t dqk, int64_t dv, T scale, T* ws, int ws_threads) {
  const int64_t qs = nh * dqk, vs = nh * dv;  // token strides
  const int64_t tiles = (S + kAttnTile - 1) / kAttnTile;
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kAttnTile, rows = std::min(kAttnTile, S - i0), keys = i0 + rows;
        const T* Qb = Q + b * S * qs + h * dqk;
        const T* Kb = K + b * S * qs + h * dqk;
        const T* Vb = V + b * S * vs + h * dv;
        T* P = attention_block(ws, S);
        blas_gemm_ld(P, keys, Qb + i0 * qs, qs, Kb, qs, rows, keys, dqk, false, true, scale, T(0));
        for (int64_t r = 0; r < rows; ++r)
          lse[(b * nh + h) * S + i0 + r] = causal_softmax_row(P + r * keys, i0 + r + 1, keys);
        blas_gemm_ld(O + b * S * vs + h * dv + i0 * vs, vs, P, keys, Vb, vs, rows, dv, keys, false,
                     false, T(1), T(0));
      }
    }
  }
}

template <class T>
void attention_backward(T* dQ, T* dK, T* dV, const T* dO, const T* Q, const T* K, const T* V,
                        const T* O, const T* lse, int64_t B, int64_t S, int64_t nh, int64_t dqk,
                        int64_t dv, T scale, T* ws, int ws_threads) {
  const int64_t qs = nh * dqk, vs = nh * dv;
  const int64_t tiles = (S + kAttnTile - 1) / kAttnTile;
  // dK and dV collect over all query tiles of a (sequence, head): one thread owns the pair.
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(ws_threads)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t qo = b * S * qs + h * dqk, vo = b * S * vs + h * dv;
      for (int64_t i = 0; i < S; ++i) {
        std::fill(dK + qo + i * qs, dK + qo + i * qs + dqk, T(0));
        std::fill(dV + vo + i * vs, dV + vo + i * vs + dv, T(0));
      }
      T* P = attention_block(ws, S);
      T* dP = P + kAttnTile * S;
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t i0 = tile * kAttnTile, rows = std::min(kAttnTile, S - i0), keys = i0 + rows;
        blas_gemm_ld(P, keys, Q + qo + i0 * qs, qs, K + qo, qs, rows, keys, dqk, false, true, scale, T(0));
        blas_gemm_ld(dP, keys, dO + vo + i0 * vs, vs, V + vo, vs, rows, keys, dv, false, true, T(1), T(0));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r, visible = i + 1;
          const T L = lse[(b * nh + h) * S + i];
          const T* dout = dO + vo + i * vs;
          const T* o = O + vo + i * vs;
          T Di = 0;
          for (int64_t d = 0; d < dv; ++d) Di += dout[d] * o[d];
          causal_softmax_grad_row(P + r * keys, dP + r * keys, visible, keys, L, Di, scale);
        }
        blas_gemm_ld(dQ + qo + i0 * qs, qs, dP, keys, K + qo, qs, rows, dqk, keys, false, false, T(1), T(0));
        blas_gemm_ld(dK + qo, qs, dP, keys, Q + qo + i0 * qs, qs, keys, dqk, rows, true, false, T(1), T(1));
        blas_gemm_ld(dV + vo, vs, P, keys, dO + vo + i0 * vs, vs, keys, dv, rows, true, false, T(1), T(1));
      }
    }
  }
}

// ---- SwiGLU on a fused [G | U] row --------------------------------------------------------

// One row: m [I] from gu [2I] = [g | u] (the 16-bit-output op reuses it, so its values are
// these bit for bit).
template <class T>
inline void swiglu_row(T* m, const T* gu, int64_t I) {
  const T* g = gu;
  const T* u = gu + I;
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) m[i] = math::swiglu(g[i], u[i], VExp{});
}
template <class T>
void swiglu_forward(T* M, const T* GU, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) swiglu_row(M + t * I, GU + t * 2 * I, I);
}

// One row: dgu [2I] = [dG | dU] from dm [I] and gu [2I] (reused by the 16-bit-output op).
template <class T>
inline void swiglu_backward_row(T* dgu, const T* dm, const T* gu, int64_t I) {
  const T* g = gu;
  const T* u = gu + I;
  T* dg = dgu;
  T* du = dgu + I;
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const T sg = math::sigmoid(g[i], VExp{});
    du[i] = math::swiglu_du(dm[i], g[i], sg);
    dg[i] = math::swiglu_dg(dm[i], g[i], u[i], sg);
  }
}
template <class T>
void swiglu_backward(T* dGU, const T* dM, const T* GU, int64_t N, int64_t I) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) swiglu_backward_row(dGU + t * 2 * I, dM + t * I, GU + t * 2 * I, I);
}

// ---- Router (docs/model.md §3.6 and §4) ----------------------------------------------------------

// The most experts (and groups) a router row takes on the CPU.
inline constexpr int kRouterMaxExperts = 1024;

// Per token: dstrain/kernels/row_math.h's router rows (the scores' sigmoid through vexp, the
// softmax through std::exp).
struct StdExp {
  template <class T>
  T operator()(T x) const {
    return std::exp(x);
  }
};

template <class T>
void router_forward(int32_t* idx, T* w, T* scores, const T* logits, const T* bias, int64_t N,
                    const RouterParams& p) {
  const int64_t E = p.num_experts, k = p.top_k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    math::router_forward_row<kRouterMaxExperts, kRouterMaxExperts>(idx + t * k, w + t * k, scores + t * E,
                                                                   logits + t * E, bias, p, VExp{}, StdExp{});
}

template <class T>
void router_backward(T* dlogits, const T* dw, const T* dscores_extra, const T* scores,
                     const int32_t* idx, int64_t N, const RouterParams& p) {
  const int64_t E = p.num_experts, k = p.top_k;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    math::router_backward_row(dlogits + t * E, dw + t * k, dscores_extra ? dscores_extra + t * E : nullptr,
                              scores + t * E, idx + t * k, p);
}

// ---- MoE data movement ----------------------------------------------------------------------

template <class T>
void gather_rows(T* out, const T* in, const int32_t* src, int64_t n, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) std::copy(in + src[i] * H, in + (src[i] + 1) * H, out + i * H);
}

template <class T>
void moe_combine(T* out, const T* Y, const T* w, const int32_t* pos, int64_t N, int64_t k, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    T* o = out + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const T wj = w[t * k + j];
      const T* y = Y + int64_t(pos[t * k + j]) * H;
      for (int64_t c = 0; c < H; ++c) o[c] += wj * y[c];
    }
  }
}

// One (token, choice): dy [H] = wj g, and <g, y> returned (the 16-bit-output op reuses it). The
// dot product runs in 16 fixed lanes (column c into lane c % 16), summed by a fixed tree, then
// the tail: vectorised, and the same bits on every instruction set (one running sum was a
// scalar chain of H dependent adds).
template <class T>
inline T moe_combine_backward_row(T* dy, const T* g, const T* y, T wj, int64_t H) {
  constexpr int64_t kLanes = 16;
  T acc[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= H; c += kLanes) {
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) {
      acc[l] += g[c + l] * y[c + l];
      dy[c + l] = wj * g[c + l];
    }
  }
  T tail = 0;
  for (; c < H; ++c) {
    tail += g[c] * y[c];
    dy[c] = wj * g[c];
  }
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0] + tail;
}
template <class T>
void moe_combine_backward(T* dY, T* dw, const T* dout, const T* Y, const T* w, const int32_t* pos,
                          int64_t N, int64_t k, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = pos[t * k + j];
      dw[t * k + j] = moe_combine_backward_row(dY + row * H, dout + t * H, Y + row * H, w[t * k + j], H);
    }
}

template <class T>
void moe_dispatch_backward(T* dx, const T* dXp, const int32_t* pos, int64_t N, int64_t k, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    T* d = dx + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const T* src = dXp + int64_t(pos[t * k + j]) * H;
      for (int64_t c = 0; c < H; ++c) d[c] += src[c];
    }
  }
}

// ---- Loss, embedding, optimizer, element-wise -----------------------------------------------

template <class T>
void cross_entropy(T* loss, T* logits, const int32_t* target, int64_t rows, int64_t V, T grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* l = logits + r * V;
    const int32_t y = target[r];
    if (y < 0) {
      loss[r] = 0;
      std::fill(l, l + V, T(0));
      continue;
    }
    T mx = l[0];
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, l[v]);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < V; ++v) sum += vexp(l[v] - mx);
    const T lse = math::log_sum_exp(mx, sum);
    loss[r] = lse - l[y];
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) l[v] = math::ce_grad(l[v], lse, grad_scale, VExp{});
    l[y] = math::ce_grad_target(l[y], grad_scale);
  }
}

// Vocabulary-parallel cross-entropy (docs/model.md §10.1): each rank holds the logits of its
// vocabulary columns [v0, v0 + V); the row maxima and the sums are reduced over the ranks
// between the three steps.
template <class T>
void cross_entropy_row_max(T* row_max, const T* logits, int64_t rows, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* l = logits + r * V;
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, l[v]);
    row_max[r] = mx;
  }
}

// sums[r, 0] = sum_v exp(logits[r, v] - row_max[r]); sums[r, 1] = the target's logit when this
// rank holds its column, else 0.
template <class T>
void cross_entropy_row_sums(T* sums, const T* logits, const T* row_max, const int32_t* target, int64_t v0,
                            int64_t rows, int64_t V) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* l = logits + r * V;
    const T mx = row_max[r];
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < V; ++v) sum += vexp(l[v] - mx);
    const int64_t y = int64_t(target[r]) - v0;
    sums[2 * r] = sum;
    sums[2 * r + 1] = target[r] >= 0 && y >= 0 && y < V ? l[y] : T(0);
  }
}

// With the maxima and sums reduced over the ranks: loss[r] = max + log(sum) - target logit, and
// logits overwritten by this rank's columns of (softmax - onehot) * grad_scale. Rows whose
// target is -100 get loss 0 and a zero gradient.
template <class T>
void cross_entropy_finish(T* loss, T* logits, const T* row_max, const T* sums, const int32_t* target, int64_t v0,
                          int64_t rows, int64_t V, T grad_scale) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* l = logits + r * V;
    if (target[r] < 0) {
      loss[r] = 0;
      std::fill(l, l + V, T(0));
      continue;
    }
    const T lse = math::log_sum_exp(row_max[r], sums[2 * r]);
    loss[r] = lse - sums[2 * r + 1];
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) l[v] = math::ce_grad(l[v], lse, grad_scale, VExp{});
    const int64_t y = int64_t(target[r]) - v0;
    if (y >= 0 && y < V) l[y] = math::ce_grad_target(l[y], grad_scale);
  }
}

// Rows with a negative id (a token another rank's vocabulary shard holds) are zero.
template <class T>
void embedding_forward(T* out, const T* table, const int32_t* ids, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    T* o = out + t * H;
    if (ids[t] < 0) std::fill(o, o + H, T(0));
    else std::copy(table + int64_t(ids[t]) * H, table + int64_t(ids[t] + 1) * H, o);
  }
}

template <class T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t N, int64_t H, int64_t) {
  // Column blocks per thread: repeated ids accumulate without races.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (H + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * kBlock, c1 = std::min(H, c0 + kBlock);
    for (int64_t t = 0; t < N; ++t) {
      if (ids[t] < 0) continue;  // not in this rank's vocabulary shard
      T* d = dtable + int64_t(ids[t]) * H;
      const T* g = dout + t * H;
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  }
}

// Adam's update of elements [0, n) on the calling thread (vectorised). adamw() below runs it over
// the threads; the fused AdamW + compute-copy refresh (CpuBackend::adamw_round) runs it per block,
// so the two give the same bits.
template <class T>
struct AdamWStep {
  math::AdamWConsts<T> k;
  explicit AdamWStep(const AdamWParams& p) : k(math::adamw_consts<T>(p)) {}
  void run(T* param, const T* grad, T* m, T* v, int64_t n) const {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) math::adamw_element(&param[i], grad[i], &m[i], &v[i], k);
  }
};

template <class T>
void adamw(T* param, const T* grad, T* m, T* v, int64_t n, const AdamWParams& p) {
  const AdamWStep<T> s(p);
  constexpr int64_t kBlock = 4096;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kBlock;
    s.run(param + i, grad + i, m + i, v + i, std::min(kBlock, n - i));
  }
}

template <class T>
void add(T* y, const T* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <class T>
void copy_strided(T* dst, int64_t ds, const T* src, int64_t ss, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * ss, src + r * ss + cols, dst + r * ds);
}

template <class T>
void add_strided(T* dst, int64_t ds, const T* src, int64_t ss, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * ds + c] += src[r * ss + c];
}

}  // namespace dstrain::kernels::cpu
