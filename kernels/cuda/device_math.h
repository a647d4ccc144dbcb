// The per-element and per-row math of the CUDA backend (docs/design.md §6.11), written once as
// __host__ __device__ functions — the formulas the CPU backend shares are dstrain/kernels/
// row_math.h's, bound here to fp32 and expf: the CUDA kernels (kernels/cuda/*.cu) call them per
// thread or per warp, and tests/kernels/test_device_math.cpp compiles the same functions with the host compiler
// and checks them against the CPU backend — conversions bit for bit, RoPE / SwiGLU / router /
// AdamW / attention rows to float tolerance — so the indexing, masking and numerics are tested
// on machines without a GPU. Only the launch geometry and the warp shuffles stay device-only.
//
// Warp-cooperative row functions take LANES (32 on the GPU, 1 in the host tests), the caller's
// lane and a `sum` functor that returns the all-lane sum of a float (a shuffle reduction on the
// GPU, the identity with one lane); lane l handles elements l, l + LANES, ... of a row.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/row_math.h"

#if defined(__CUDACC__)
#define DSTRAIN_HD __host__ __device__ __forceinline__
#else
#define DSTRAIN_HD inline
#endif

namespace dstrain::kernels::dev {

// ---- Storage types ---------------------------------------------------------------------------

// KIND: 0 fp32 (float), 1 bf16, 2 fp16 (uint16_t bit patterns); Storage<KIND> is the element.
template <int KIND>
struct StorageOf {
  using type = uint16_t;
};
template <>
struct StorageOf<0> {
  using type = float;
};
template <int KIND>
using Storage = typename StorageOf<KIND>::type;

DSTRAIN_HD uint32_t f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}
DSTRAIN_HD float bits_f32(uint32_t u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}
DSTRAIN_HD float neg_inf() { return bits_f32(0xff800000u); }

// fp32 -> bf16, round to nearest even; NaN kept quiet.
DSTRAIN_HD uint16_t to_bf16(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
DSTRAIN_HD float from_bf16(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

// fp32 -> IEEE fp16, round to nearest even, subnormals kept, overflow to infinity (from 65520),
// NaN kept quiet — in integer arithmetic, so host and device agree bit for bit.
DSTRAIN_HD uint16_t to_fp16(float x) {
  const uint32_t u = f32_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (a < 0x38800000u) {  // below 2^-14: the result is a multiple of 2^-24
    const uint32_t e = a >> 23;
    if (e < 102) return uint16_t(sign);  // below 2^-25: rounds to zero (2^-25 itself is a tie, to even 0)
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // value = mant * 2^(e - 150)
    const uint32_t shift = 126u - e;                     // value * 2^24 = mant >> shift
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  const uint32_t m = a - 0x38000000u;
  return uint16_t(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));
}
DSTRAIN_HD float from_fp16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return bits_f32(sign | f32_bits(float(m) * 5.9604644775390625e-8f));
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

template <int KIND>
DSTRAIN_HD float load(const Storage<KIND>* p, int64_t i) {
  if constexpr (KIND == 0) return p[i];
  else if constexpr (KIND == 1) return from_bf16(p[i]);
  else return from_fp16(p[i]);
}
template <int KIND>
DSTRAIN_HD Storage<KIND> store_as(float x) {
  if constexpr (KIND == 0) return x;
  else if constexpr (KIND == 1) return to_bf16(x);
  else return to_fp16(x);
}
// x rounded to the type and back (the identity for fp32): what a 16-bit GEMM operand holds.
template <int KIND>
DSTRAIN_HD float round_to(float x) {
  if constexpr (KIND == 0) return x;
  else if constexpr (KIND == 1) return from_bf16(to_bf16(x));
  else return from_fp16(to_fp16(x));
}

// ---- Element-wise ----------------------------------------------------------------------------
// The formulas are dstrain/kernels/row_math.h's, shared with the CPU backend; these names bind
// them to fp32 and expf for the kernels.

struct DeviceExp {
  DSTRAIN_HD float operator()(float x) const { return expf(x); }
};
DSTRAIN_HD float swiglu(float g, float u) { return math::swiglu(g, u, DeviceExp{}); }
DSTRAIN_HD void swiglu_grad(float dm, float g, float u, float* dg, float* du) {
  math::swiglu_grad(dm, g, u, dg, du, DeviceExp{});
}
using math::rope_first;
using math::rope_rotate;
using math::rope_rotate_back;
using math::rope_second;
using AdamWConsts = math::AdamWConsts<float>;
inline AdamWConsts adamw_consts(const AdamWParams& p) { return math::adamw_consts<float>(p); }
using math::adamw_element;

// ---- Router, one token (docs/model.md §3.6) --------------------------------------------------
// dstrain/kernels/row_math.h's rows, with expf for both scoring functions. The CUDA backend uses
// MAXE 256 / MAXG 64 and checks the config against them; the host tests use 1024 / 1024.

template <int MAXE, int MAXG>
DSTRAIN_HD void router_forward_row(int32_t* idx, float* w, float* s, const float* l, const float* bias,
                                   const RouterParams& p) {
  math::router_forward_row<MAXE, MAXG>(idx, w, s, l, bias, p, DeviceExp{}, DeviceExp{});
}
DSTRAIN_HD void router_backward_row(float* dl, const float* dw, const float* dscores_extra, const float* s,
                                    const int32_t* id, const RouterParams& p) {
  math::router_backward_row(dl, dw, dscores_extra, s, id, p);
}

// ---- Balance loss (docs/model.md §3.7) -------------------------------------------------------
// The sums of Backend::moe_balance_stats / moe_balance_grad, per cell and per token: the CUDA
// kernels run one thread per (group, expert) cell and per token over them, in the CPU backend's
// order term by term, so both give the same doubles.
using BalanceShape = Backend::BalanceShape;

// The group of this call's token i (group_len 0: one group).
DSTRAIN_HD int64_t balance_group_of(const BalanceShape& b, int64_t i) {
  return b.group_len > 0 ? (b.first + i) / b.group_len : 0;
}
// This call's tokens [lo, hi) that fall in group g.
DSTRAIN_HD void balance_group_range(const BalanceShape& b, int64_t g, int64_t* lo, int64_t* hi) {
  *lo = 0, *hi = b.n;
  if (b.group_len > 0) {
    const int64_t a = g * b.group_len - b.first, z = (g + 1) * b.group_len - b.first;
    *lo = a > 0 ? a : 0;
    *hi = z < b.n ? z : b.n;
    if (*hi < *lo) *hi = *lo;
  } else if (g != 0) {
    *hi = *lo;
  }
}
// A token's score sum.
DSTRAIN_HD double balance_row_sum(const float* s, int64_t E) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += s[e];
  return sum;
}
// Cell (g, e): f, the selections of expert e times E / (k T), and P, the mean over T of the
// tokens' normalised scores for e, over the group's tokens in order (rowsum: balance_row_sum).
DSTRAIN_HD void balance_stats_cell(double* f, double* P, const int32_t* idx, const float* scores, const double* rowsum,
                                   const BalanceShape& b, int64_t g, int64_t e) {
  int64_t lo = 0, hi = 0;
  balance_group_range(b, g, &lo, &hi);
  double fs = 0, ps = 0;
  for (int64_t i = lo; i < hi; ++i) {
    for (int64_t j = 0; j < b.k; ++j)
      if (idx[i * b.k + j] == e) fs += double(b.E) / double(b.k * b.T);
    ps += scores[i * b.E + e] / rowsum[i] / double(b.T);
  }
  *f = fs, *P = ps;
}
// One token's gradient: dL/ds'_e = weight f_e / T through s' = s / sum(s), times grad_scale
// (fg: the token's group's f).
DSTRAIN_HD void balance_grad_row(float* ds, const float* fg, const float* s, const BalanceShape& b, double weight,
                                 double grad_scale) {
  const double sum = balance_row_sum(s, b.E);
  double dot = 0;
  for (int64_t e = 0; e < b.E; ++e) dot += weight * fg[e] / double(b.T) * s[e] / sum;
  for (int64_t e = 0; e < b.E; ++e) ds[e] = float((weight * fg[e] / double(b.T) - dot) / sum * grad_scale);
}
// weight x the sum over groups and experts of f P (stats as moe_balance_stats leaves them).
DSTRAIN_HD double balance_aux_total(const float* stats, const BalanceShape& b, double weight) {
  const float* f = stats;
  const float* P = stats + b.groups * b.E;
  double total = 0;
  for (int64_t g = 0; g < b.groups; ++g) {
    double loss = 0;
    for (int64_t e = 0; e < b.E; ++e) loss += double(f[g * b.E + e]) * double(P[g * b.E + e]);
    total += weight * loss;
  }
  return total;
}

// ---- Causal attention, one row per lane group -----------------------------------------------
// Q, K [B,S,nh,dqk], V [B,S,nh,dv] in the storage type; O fp32. Scores s_ij = scale * q_i . k_j
// for j <= i. Forward takes two passes over the keys: the first finds the row's log-sum-exp L
// (running max and rescaled sum), the second accumulates p_ij V_j with p_ij = exp(s_ij - L)
// rounded to the storage type — the probabilities the CPU backend's 16-bit kernel feeds its
// P V GEMM. Backward recomputes p_ij from L: dP_ij = dO_i . V_j (dO in the storage type), dS_ij =
// p_ij (dP_ij - D_i) scale with D_i = dO_i . O_i (fp32), rounded to the storage type before it
// multiplies K (for dQ) or Q (for dK); dV_j collects round(p_ij) dO_i. MAXD bounds dqk and dv.

struct AttnShape {
  int64_t B, S, nh, dqk, dv;
  float scale;
};

// q_i . k_j over the lane's share of dqk, summed over the lanes.
template <int KIND, int LANES, int MAXD, class Sum>
DSTRAIN_HD float attn_dot(const float* qr, const Storage<KIND>* k, int64_t d, int lane, Sum sum) {
  float acc = 0;
  for (int r = 0; r < MAXD / LANES; ++r) {
    const int64_t c = lane + int64_t(r) * LANES;
    if (c < d) acc += qr[r] * load<KIND>(k, c);
  }
  return sum(acc);
}

template <int KIND, int LANES, int MAXD>
DSTRAIN_HD void attn_load_row(float* r_out, const Storage<KIND>* x, int64_t d, int lane) {
  for (int r = 0; r < MAXD / LANES; ++r) {
    const int64_t c = lane + int64_t(r) * LANES;
    r_out[r] = c < d ? load<KIND>(x, c) : 0.0f;
  }
}

// Row (b, h, i) of the forward: O_i and lse_i (lse [B,nh,S]).
template <int KIND, int LANES, int MAXD, class Sum>
DSTRAIN_HD void attention_forward_row(float* O, float* lse, const Storage<KIND>* Q, const Storage<KIND>* K,
                                      const Storage<KIND>* V, const AttnShape& a, int64_t b, int64_t h, int64_t i,
                                      int lane, Sum sum) {
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv;
  const Storage<KIND>* Kb = K + b * a.S * qs + h * a.dqk;
  const Storage<KIND>* Vb = V + b * a.S * vs + h * a.dv;
  float q[MAXD / LANES];
  attn_load_row<KIND, LANES, MAXD>(q, Q + (b * a.S + i) * qs + h * a.dqk, a.dqk, lane);
  float m = neg_inf(), l = 0;
  for (int64_t j = 0; j <= i; ++j) {
    const float s = attn_dot<KIND, LANES, MAXD>(q, Kb + j * qs, a.dqk, lane, sum) * a.scale;
    if (s > m) {
      l = l * expf(m - s) + 1.0f;
      m = s;
    } else {
      l += expf(s - m);
    }
  }
  const float L = math::log_sum_exp(m, l);
  float o[MAXD / LANES] = {};
  for (int64_t j = 0; j <= i; ++j) {
    const float s = attn_dot<KIND, LANES, MAXD>(q, Kb + j * qs, a.dqk, lane, sum) * a.scale;
    const float p = round_to<KIND>(expf(s - L));
    for (int r = 0; r < MAXD / LANES; ++r) {
      const int64_t c = lane + int64_t(r) * LANES;
      if (c < a.dv) o[r] += p * load<KIND>(Vb + j * vs, c);
    }
  }
  float* orow = O + (b * a.S + i) * vs + h * a.dv;
  for (int r = 0; r < MAXD / LANES; ++r) {
    const int64_t c = lane + int64_t(r) * LANES;
    if (c < a.dv) orow[c] = o[r];
  }
  if (lane == 0) lse[(b * a.nh + h) * a.S + i] = L;
}

// D_i = dO_i . O_i (fp32), D [B,nh,S].
template <int LANES, class Sum>
DSTRAIN_HD void attention_rowsum(float* D, const float* dO, const float* O, const AttnShape& a, int64_t b, int64_t h,
                                 int64_t i, int lane, Sum sum) {
  const int64_t off = (b * a.S + i) * a.nh * a.dv + h * a.dv;
  float acc = 0;
  for (int64_t c = lane; c < a.dv; c += LANES) acc += dO[off + c] * O[off + c];
  acc = sum(acc);
  if (lane == 0) D[(b * a.nh + h) * a.S + i] = acc;
}

// Row i of dQ: sum over j <= i of round(dS_ij) k_j.
template <int KIND, int LANES, int MAXD, class Sum>
DSTRAIN_HD void attention_backward_dq_row(float* dQ, const Storage<KIND>* dO, const Storage<KIND>* Q,
                                          const Storage<KIND>* K, const Storage<KIND>* V, const float* lse,
                                          const float* D, const AttnShape& a, int64_t b, int64_t h, int64_t i,
                                          int lane, Sum sum) {
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv;
  const Storage<KIND>* Kb = K + b * a.S * qs + h * a.dqk;
  const Storage<KIND>* Vb = V + b * a.S * vs + h * a.dv;
  float q[MAXD / LANES], g[MAXD / LANES], dq[MAXD / LANES] = {};
  attn_load_row<KIND, LANES, MAXD>(q, Q + (b * a.S + i) * qs + h * a.dqk, a.dqk, lane);
  attn_load_row<KIND, LANES, MAXD>(g, dO + (b * a.S + i) * vs + h * a.dv, a.dv, lane);
  const float L = lse[(b * a.nh + h) * a.S + i], Di = D[(b * a.nh + h) * a.S + i];
  for (int64_t j = 0; j <= i; ++j) {
    const float p = expf(attn_dot<KIND, LANES, MAXD>(q, Kb + j * qs, a.dqk, lane, sum) * a.scale - L);
    const float dp = attn_dot<KIND, LANES, MAXD>(g, Vb + j * vs, a.dv, lane, sum);
    const float ds = round_to<KIND>(math::softmax_grad(p, dp, Di, a.scale));
    for (int r = 0; r < MAXD / LANES; ++r) {
      const int64_t c = lane + int64_t(r) * LANES;
      if (c < a.dqk) dq[r] += ds * load<KIND>(Kb + j * qs, c);
    }
  }
  float* out = dQ + (b * a.S + i) * qs + h * a.dqk;
  for (int r = 0; r < MAXD / LANES; ++r) {
    const int64_t c = lane + int64_t(r) * LANES;
    if (c < a.dqk) out[c] = dq[r];
  }
}

// Row j of dK and dV: sums over the queries i >= j.
template <int KIND, int LANES, int MAXD, class Sum>
DSTRAIN_HD void attention_backward_dkv_row(float* dK, float* dV, const Storage<KIND>* dO, const Storage<KIND>* Q,
                                           const Storage<KIND>* K, const Storage<KIND>* V, const float* lse,
                                           const float* D, const AttnShape& a, int64_t b, int64_t h, int64_t j,
                                           int lane, Sum sum) {
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv;
  const Storage<KIND>* Qb = Q + b * a.S * qs + h * a.dqk;
  const Storage<KIND>* dOb = dO + b * a.S * vs + h * a.dv;
  float k[MAXD / LANES], v[MAXD / LANES], dk[MAXD / LANES] = {}, dv[MAXD / LANES] = {};
  attn_load_row<KIND, LANES, MAXD>(k, K + (b * a.S + j) * qs + h * a.dqk, a.dqk, lane);
  attn_load_row<KIND, LANES, MAXD>(v, V + (b * a.S + j) * vs + h * a.dv, a.dv, lane);
  for (int64_t i = j; i < a.S; ++i) {
    const float L = lse[(b * a.nh + h) * a.S + i], Di = D[(b * a.nh + h) * a.S + i];
    const float p = expf(attn_dot<KIND, LANES, MAXD>(k, Qb + i * qs, a.dqk, lane, sum) * a.scale - L);
    const float dp = attn_dot<KIND, LANES, MAXD>(v, dOb + i * vs, a.dv, lane, sum);
    const float ds = round_to<KIND>(math::softmax_grad(p, dp, Di, a.scale)), pr = round_to<KIND>(p);
    for (int r = 0; r < MAXD / LANES; ++r) {
      const int64_t c = lane + int64_t(r) * LANES;
      if (c < a.dqk) dk[r] += ds * load<KIND>(Qb + i * qs, c);
      if (c < a.dv) dv[r] += pr * load<KIND>(dOb + i * vs, c);
    }
  }
  float* ko = dK + (b * a.S + j) * qs + h * a.dqk;
  float* vo = dV + (b * a.S + j) * vs + h * a.dv;
  for (int r = 0; r < MAXD / LANES; ++r) {
    const int64_t c = lane + int64_t(r) * LANES;
    if (c < a.dqk) ko[c] = dk[r];
    if (c < a.dv) vo[c] = dv[r];
  }
}


// ---- Causal attention, tiled for tensor cores (16-bit Q, K, V) ------------------------------
// The same results as the row functions above — probabilities p_ij = exp(s_ij - L_i) from the
// row's final log-sum-exp, rounded to the storage type before P V; dS rounded before it
// multiplies K or Q — computed a tile at a time. A block of four warps owns kFlashRows query
// rows (or, for dK / dV, keys), 16 per warp; it walks tiles of kFlashCols keys (queries) held in
// shared memory, and each warp forms its 16 x kFlashCols score tile with tensor-core MMAs into
// a float tile (row stride kFlashLdS). Lane l then owns row l % 16, columns (l / 16) * 32 ..
// + 32 of that tile: it reads its 32 values into registers (flash_read_lane), the warp
// synchronises, and it writes 16-bit results over the same bytes (row stride kFlashLdP), which
// the next MMAs read. The forward makes two passes over the keys (the first for L, the second
// for P V), so P needs no rescaling; dQ and dK / dV are separate kernels, so no output is
// summed by two blocks (no atomics: the same bits every run).

constexpr int kFlashRows = 64;           // query rows (keys for dK / dV) per block: 4 warps x 16
constexpr int kFlashCols = 64;           // keys (queries) per tile
constexpr int kFlashLdS = kFlashCols + 4;  // floats per row of a warp's score tile
constexpr int kFlashLdP = kFlashCols + 8;  // 16-bit values per row of the same bytes reused
constexpr int kFlashLane = kFlashCols / 2;  // columns per lane

DSTRAIN_HD int flash_lane_row(int lane) { return lane % 16; }
DSTRAIN_HD int flash_lane_col(int lane) { return (lane / 16) * kFlashLane; }
// Key tiles a query block starting at i0 visits: those holding a key <= its last row.
DSTRAIN_HD int64_t flash_key_tiles(int64_t i0, int64_t S) {
  const int64_t last = (i0 + kFlashRows < S ? i0 + kFlashRows : S) - 1;
  return last / kFlashCols + 1;
}
// Whether a warp whose first row is r0 has work in the tile of columns c0.. : forward and dQ
// (rows are queries, columns keys: some key <= some row), dK / dV (rows keys, columns queries:
// some query >= some key, always true of the tiles it visits, so only r0 < S matters).
DSTRAIN_HD bool flash_query_warp_sees(int64_t r0, int64_t c0, int64_t S) { return r0 < S && c0 <= r0 + 15; }
DSTRAIN_HD bool flash_key_warp_sees(int64_t r0, int64_t S) { return r0 < S; }

// The lane's 32 values of a warp's float tile.
DSTRAIN_HD void flash_read_lane(float* v, const float* tile, int lane) {
  const float* row = tile + flash_lane_row(lane) * kFlashLdS + flash_lane_col(lane);
  for (int c = 0; c < kFlashLane; ++c) v[c] = row[c];
}

// Forward, first pass: the lane's raw scores of query row i against keys j0 + its columns,
// into its running maximum m and sum l of exp(scale s - m) (keys j <= i only).
DSTRAIN_HD void flash_stats_lane(const float* s, int lane, int64_t i, int64_t j0, float scale, float& m, float& l) {
  const int64_t j = j0 + flash_lane_col(lane);
  for (int c = 0; c < kFlashLane && j + c <= i; ++c) {
    const float x = s[c] * scale;
    if (x > m) {
      l = l * expf(m - x) + 1.0f;
      m = x;
    } else {
      l += expf(x - m);
    }
  }
}
// Two (m, l) partial states of one row into the first.
DSTRAIN_HD void flash_merge(float& m, float& l, float m2, float l2) {
  const float M = m > m2 ? m : m2;
  if (M == neg_inf()) return;
  l = (m == neg_inf() ? 0.0f : l * expf(m - M)) + (m2 == neg_inf() ? 0.0f : l2 * expf(m2 - M));
  m = M;
}

// Forward, second pass: p_ij = exp(scale s_ij - L) rounded to the storage type (0 where j > i
// or the row is past the sequence), written to the lane's columns of the 16-bit tile P.
template <int KIND>
DSTRAIN_HD void flash_probs_lane(uint16_t* P, const float* s, int lane, int64_t i, int64_t j0, int64_t S, float scale,
                                 float L) {
  static_assert(KIND != 0, "the tiled attention is for 16-bit storage");
  uint16_t* row = P + flash_lane_row(lane) * kFlashLdP + flash_lane_col(lane);
  const int64_t j = j0 + flash_lane_col(lane);
  for (int c = 0; c < kFlashLane; ++c)
    row[c] = (i < S && j + c <= i) ? store_as<KIND>(expf(s[c] * scale - L)) : uint16_t(0);
}

// dQ: dS_ij = p_ij (dP_ij - D_i) scale rounded, p_ij = exp(scale s_ij - L_i) (not rounded).
template <int KIND>
DSTRAIN_HD void flash_dq_lane(uint16_t* dS, const float* s, const float* dp, int lane, int64_t i, int64_t j0,
                              int64_t S, float scale, float L, float D) {
  static_assert(KIND != 0, "the tiled attention is for 16-bit storage");
  uint16_t* row = dS + flash_lane_row(lane) * kFlashLdP + flash_lane_col(lane);
  const int64_t j = j0 + flash_lane_col(lane);
  for (int c = 0; c < kFlashLane; ++c)
    row[c] = (i < S && j + c <= i) ? store_as<KIND>(math::softmax_grad(expf(s[c] * scale - L), dp[c], D, scale))
                                   : uint16_t(0);
}

// dK / dV: rows are keys j, columns queries i0 + c (with L, D of the tile's queries): the
// transposed probabilities rounded (for dV) and the transposed dS (for dK), 0 where i < j or
// either is past the sequence.
template <int KIND>
DSTRAIN_HD void flash_dkv_lane(uint16_t* Pt, uint16_t* dSt, const float* st, const float* dpt, int lane, int64_t j,
                               int64_t i0, int64_t S, float scale, const float* L, const float* D) {
  static_assert(KIND != 0, "the tiled attention is for 16-bit storage");
  const int c0 = flash_lane_col(lane);
  uint16_t* prow = Pt + flash_lane_row(lane) * kFlashLdP + c0;
  uint16_t* drow = dSt + flash_lane_row(lane) * kFlashLdP + c0;
  for (int c = 0; c < kFlashLane; ++c) {
    const int64_t i = i0 + c0 + c;
    if (j < S && i < S && i >= j) {
      const float p = expf(st[c] * scale - L[c0 + c]);
      prow[c] = store_as<KIND>(p);
      drow[c] = store_as<KIND>(math::softmax_grad(p, dpt[c], D[c0 + c], scale));
    } else {
      prow[c] = 0, drow[c] = 0;
    }
  }
}

}  // namespace dstrain::kernels::dev
