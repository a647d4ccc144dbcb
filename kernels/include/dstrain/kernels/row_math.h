// The per-element math of the kernels, written once (docs/design.md §6.11, "One row-math
// source"): the CPU backend's templates (kernels/cpu/cpu_ops.h, instantiated in float and, for
// the finite-difference tests, double) and the CUDA backend's kernels (directly, and through
// kernels/cuda/device_math.h's fp32 bindings) evaluate these functions, so a formula changed here
// changes on both. What stays per backend is how a row is walked and reduced — OpenMP loops the
// compiler vectorises on the CPU; threads, warps and blocks with fixed-order reductions on the
// GPU — and the exponential, passed in as `exp`: on the CPU the vectorising vexp (std::exp for the
// router's softmax, as before), on the GPU expf.
//
// Covered: SwiGLU, RoPE, RMSNorm, AdamW, the router (scores, group-limited top-k, weights and
// their gradient) and the softmax rows' element math (log-sum-exp, the softmax gradient, the
// cross-entropy's gradient). How a softmax row finds its maximum and sum stays per backend: a
// score tile's max then one pass on the CPU, a running maximum per warp (online softmax) on the
// GPU.
#pragma once

#include <cmath>
#include <cstdint>

#include "dstrain/kernels/backend.h"

// Always inlined: the CPU's bits depend on it (the compiler fuses a multiply into the add it
// feeds only within one inlined expression).
#if defined(__CUDACC__)
#define DSTRAIN_ROW_MATH __host__ __device__ __forceinline__
#elif defined(__GNUC__)
#define DSTRAIN_ROW_MATH inline __attribute__((always_inline))
#else
#define DSTRAIN_ROW_MATH inline
#endif

namespace dstrain::kernels::math {

// IEEE square root (correctly rounded on both sides).
DSTRAIN_ROW_MATH float root(float x) { return sqrtf(x); }
DSTRAIN_ROW_MATH double root(double x) { return sqrt(x); }

// Natural logarithm (the C library's on the host, CUDA's on the device).
DSTRAIN_ROW_MATH float log_of(float x) { return logf(x); }
DSTRAIN_ROW_MATH double log_of(double x) { return log(x); }

// ---- Softmax rows: attention (docs/model.md §3.4) and the cross-entropy (§6) ----------------------

// The log-sum-exp of a row from its maximum m and sum of exp(x − m).
template <class T>
DSTRAIN_ROW_MATH T log_sum_exp(T m, T sum) {
  return m + log_of(sum);
}
// The softmax's backward for one element: dS = p (dP − D) scale, D = the row's sum of p dP (for
// attention dO · O).
template <class T>
DSTRAIN_ROW_MATH T softmax_grad(T p, T dp, T D, T scale) {
  return p * (dp - D) * scale;
}
// The cross-entropy's gradient for one logit x of a row with log-sum-exp lse: softmax(x) scaled;
// the target's then less the scale (ce_grad_target).
template <class T, class Exp>
DSTRAIN_ROW_MATH T ce_grad(T x, T lse, T grad_scale, Exp exp) {
  return exp(x - lse) * grad_scale;
}
template <class T>
DSTRAIN_ROW_MATH T ce_grad_target(T g, T grad_scale) {
  return g - grad_scale;
}

// ---- SwiGLU (docs/model.md §3.5): m = g σ(g) u ------------------------------------------------

template <class T, class Exp>
DSTRAIN_ROW_MATH T sigmoid(T x, Exp exp) {
  return T(1) / (T(1) + exp(-x));
}
template <class T, class Exp>
DSTRAIN_ROW_MATH T swiglu(T g, T u, Exp exp) {
  return g * math::sigmoid(g, exp) * u;
}
// From dm = dL/dm and sg = σ(g): du = dm g sg, dg = dm u sg (1 + g (1 − sg)). (Returned by
// value, each its own expression: the CPU loop then vectorises and fuses as it did before.)
template <class T>
DSTRAIN_ROW_MATH T swiglu_du(T dm, T g, T sg) {
  return dm * g * sg;
}
template <class T>
DSTRAIN_ROW_MATH T swiglu_dg(T dm, T g, T u, T sg) {
  return dm * u * sg * (T(1) + g * (T(1) - sg));
}
template <class T, class Exp>
DSTRAIN_ROW_MATH void swiglu_grad(T dm, T g, T u, T* dg, T* du, Exp exp) {
  const T sg = math::sigmoid(g, exp);
  *du = swiglu_du(dm, g, sg);
  *dg = swiglu_dg(dm, g, u, sg);
}

// ---- RoPE (docs/model.md §3.4.1) --------------------------------------------------------------

// Pair j of a dr-vector: its inputs (a, b) — x[2j], x[2j + 1] when interleaved, else x[j],
// x[j + dr/2] — rotated by (c, s) into out[j], out[j + dr/2].
DSTRAIN_ROW_MATH int64_t rope_first(int64_t j, int64_t, bool interleave) { return interleave ? 2 * j : j; }
DSTRAIN_ROW_MATH int64_t rope_second(int64_t j, int64_t dr, bool interleave) {
  return interleave ? 2 * j + 1 : j + dr / 2;
}
template <class T>
DSTRAIN_ROW_MATH void rope_rotate(T a, T b, T c, T s, T* o1, T* o2) {
  *o1 = a * c - b * s;
  *o2 = b * c + a * s;
}
// Its transpose: from the output gradients (ga, gb) the input gradients (da, db).
template <class T>
DSTRAIN_ROW_MATH void rope_rotate_back(T ga, T gb, T c, T s, T* da, T* db) {
  *da = ga * c + gb * s;
  *db = -ga * s + gb * c;
}

// ---- RMSNorm (docs/model.md §3.3): y = w (x r), r = 1 / sqrt(mean(x²) + eps) ---------------------

// r from the row's sum of squares over C elements.
template <class T>
DSTRAIN_ROW_MATH T rms_scale(T sum_sq, int64_t C, T eps) {
  return T(1) / root(sum_sq / T(C) + eps);
}
template <class T>
DSTRAIN_ROW_MATH T rmsnorm_out(T w, T x, T r) {
  return w * (x * r);
}
// Backward: the row's dot = mean over c of dy w x r (the sum of these terms, divided by C), then
// dx = r (dy w − x r dot); dw collects dy x r over the rows.
template <class T>
DSTRAIN_ROW_MATH T rmsnorm_dot_term(T dy, T w, T x, T r) {
  return dy * w * x * r;
}
template <class T>
DSTRAIN_ROW_MATH T rmsnorm_dx(T dy, T w, T x, T r, T dot) {
  return r * (dy * w - x * r * dot);
}
template <class T>
DSTRAIN_ROW_MATH T rmsnorm_dw_term(T dy, T x, T r) {
  return dy * x * r;
}

// ---- AdamW (docs/model.md §7) -------------------------------------------------------------------

// The constants of one step, bias correction folded in; computed once per call, on the host.
template <class T>
struct AdamWConsts {
  T b1, b2, step_size, inv_sqrt_bc2, decay, eps, scale, l2;
};
template <class T>
inline AdamWConsts<T> adamw_consts(const AdamWParams& p) {
  AdamWConsts<T> k;
  k.b1 = T(p.beta1), k.b2 = T(p.beta2), k.eps = T(p.eps), k.scale = T(p.grad_scale), k.l2 = T(p.l2);
  const T bc1 = T(1) - std::pow(k.b1, T(p.step)), bc2 = T(1) - std::pow(k.b2, T(p.step));
  k.step_size = T(p.lr) / bc1, k.inv_sqrt_bc2 = T(1) / std::sqrt(bc2);
  k.decay = T(1) - T(p.lr) * T(p.weight_decay);
  return k;
}
// One element: g = grad scale + l2 param; m, v updated; param decayed and stepped.
template <class T>
DSTRAIN_ROW_MATH void adamw_element(T* param, T grad, T* m, T* v, const AdamWConsts<T>& k) {
  const T g = grad * k.scale + k.l2 * *param;
  const T mi = *m = k.b1 * *m + (T(1) - k.b1) * g;
  const T vi = *v = k.b2 * *v + (T(1) - k.b2) * g * g;
  *param = *param * k.decay - k.step_size * mi / (root(vi) * k.inv_sqrt_bc2 + k.eps);
}

// ---- Router, one token (docs/model.md §3.6) ------------------------------------------------------
// Scores (sigmoid or softmax over the E logits), the selection values (scores, plus the bias
// under noaux_tc), group-limited selection (each group's best, or best two, the topk_group best
// groups kept), then the k best allowed experts — the lowest index on ties — and their weights.
// Written for a GPU thread per token, which must not hold E-sized arrays (the driver reserves a
// thread's local memory for every thread the device can hold: 1 KB a thread is ~270 MB on an
// H200): the selection values are recomputed where needed and the masks are bit sets. MAXE bounds
// the experts and MAXG the groups (CUDA: 256 / 64, checked against the config; the CPU: 1024 /
// 1024). `sigmoid_exp` / `softmax_exp`: the exponentials of the two scoring functions.

template <int MAXE>
struct Bits {
  uint32_t w[(MAXE + 31) / 32];
  DSTRAIN_ROW_MATH void clear(int64_t n) {
    for (int64_t i = 0; i < (n + 31) / 32; ++i) w[i] = 0;
  }
  DSTRAIN_ROW_MATH bool get(int64_t i) const { return (w[i >> 5] >> (i & 31)) & 1u; }
  DSTRAIN_ROW_MATH void set(int64_t i, bool on) {
    if (on) w[i >> 5] |= 1u << (i & 31);
    else w[i >> 5] &= ~(1u << (i & 31));
  }
};

template <int MAXE, int MAXG, class T, class SigmoidExp, class SoftmaxExp>
DSTRAIN_ROW_MATH void router_forward_row(int32_t* idx, T* w, T* s, const T* l, const T* bias, const RouterParams& p,
                                         SigmoidExp sigmoid_exp, SoftmaxExp softmax_exp) {
  const int64_t E = p.num_experts, k = p.top_k, G = p.n_group, per_group = E / G;
  if (p.scoring == ScoringFunc::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = math::sigmoid(l[e], sigmoid_exp);
  } else {
    T mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = mx < l[e] ? l[e] : mx;
    T sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (s[e] = softmax_exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) s[e] /= sum;
  }
  // Selection values: the scores, bias-corrected for noaux_tc.
  const T* b = p.method == TopkMethod::kNoauxTc ? bias : nullptr;
  const auto c = [&](int64_t e) { return s[e] + (b ? b[e] : T(0)); };
  Bits<MAXE> allowed;
  allowed.clear(E);
  for (int64_t e = 0; e < E; ++e) allowed.set(e, true);
  if (p.method != TopkMethod::kGreedy && p.topk_group < G) {
    T group_score[MAXG];
    Bits<MAXG> open;
    open.clear(G);
    for (int64_t g = 0; g < G; ++g) {
      T best = -T(INFINITY), second = best;
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
        const T v = c(e);
        if (v > best) {
          second = best;
          best = v;
        } else if (v > second) {
          second = v;
        }
      }
      group_score[g] = p.method == TopkMethod::kNoauxTc ? best + second : best;
      open.set(g, true);
    }
    for (int64_t r = 0; r < p.topk_group; ++r) {  // the best open group, the lowest on ties
      int64_t best = -1;
      for (int64_t g = 0; g < G; ++g)
        if (open.get(g) && (best < 0 || group_score[g] > group_score[best])) best = g;
      open.set(best, false);
    }
    for (int64_t e = 0; e < E; ++e) allowed.set(e, !open.get(e / per_group));  // kept groups are closed now
  }
  T sum = 0;
  for (int64_t j = 0; j < k; ++j) {  // the best allowed expert, the lowest on ties
    int64_t e = -1;
    T ce = 0;
    for (int64_t x = 0; x < E; ++x)
      if (allowed.get(x)) {
        const T v = c(x);
        if (e < 0 || v > ce) e = x, ce = v;
      }
    allowed.set(e, false);
    idx[j] = int32_t(e);
    w[j] = s[e];
    sum += s[e];
  }
  const bool normalise = p.v2_weights ? (p.norm_topk_prob && k > 1) : p.norm_topk_prob;
  const T scale = normalise ? (p.v2_weights ? T(1) : T(p.routed_scaling_factor)) / (sum + T(1e-20))
                            : T(p.routed_scaling_factor);
  for (int64_t j = 0; j < k; ++j) w[j] *= scale;
}

// The score gradient ds[e] = extra[e] + the weights' part (non-zero for the k chosen experts
// only), evaluated per expert instead of kept in an array.
template <class T>
DSTRAIN_ROW_MATH void router_backward_row(T* dl, const T* dw, const T* dscores_extra, const T* s, const int32_t* id,
                                          const RouterParams& p) {
  const int64_t E = p.num_experts, k = p.top_k;
  const bool normalise = p.v2_weights ? (p.norm_topk_prob && k > 1) : p.norm_topk_prob;
  const T gamma = p.v2_weights && normalise ? T(1) : T(p.routed_scaling_factor);
  T Z = T(1e-20), dot = 0;
  if (normalise) {
    for (int64_t j = 0; j < k; ++j) Z += s[id[j]];
    for (int64_t j = 0; j < k; ++j) dot += dw[j] * s[id[j]];
  }
  const auto ds = [&](int64_t e) {
    T d = dscores_extra ? dscores_extra[e] : T(0);
    if (normalise) {  // (two loops: each sum a multiply feeding an add, as the compiler may fuse it)
      for (int64_t j = 0; j < k; ++j)
        if (id[j] == e) d += gamma / Z * (dw[j] - dot / Z);
    } else {
      for (int64_t j = 0; j < k; ++j)
        if (id[j] == e) d += gamma * dw[j];
    }
    return d;
  };
  if (p.scoring == ScoringFunc::kSigmoid) {
    for (int64_t e = 0; e < E; ++e) dl[e] = ds(e) * s[e] * (T(1) - s[e]);
  } else {
    T sdot = 0;
    for (int64_t e = 0; e < E; ++e) sdot += ds(e) * s[e];
    for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (ds(e) - sdot);
  }
}

}  // namespace dstrain::kernels::math
