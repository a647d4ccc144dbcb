// The CUDA backend's per-element and per-row math (kernels/cuda/device_math.h), compiled here by
// the host compiler, against the CPU backend: conversions bit for bit over special and random
// values, RoPE / SwiGLU / AdamW elements, router rows, and the attention rows run with one lane
// (the GPU runs the same functions with 32) — forward, D, dQ and dK/dV, fp32 to 1e-5 and the
// 16-bit rows against fp32 attention on the rounded inputs — and the balance loss's cells and
// rows. Runs on every machine, GPU or not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "kernels/cpu/low_precision.h"
#include "kernels/cuda/device_math.h"

namespace dstrain::kernels {
namespace {

using FVec = std::vector<float>;

FVec randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  FVec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double max_rel_err(const FVec& got, const FVec& want) {
  double scale = 1e-12, err = 0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  for (size_t i = 0; i < want.size(); ++i) err = std::max(err, double(std::fabs(got[i] - want[i])));
  return err / scale;
}

using dev::f32_bits;
float from_bits(uint32_t u) { return dev::bits_f32(u); }
uint32_t bits(float x) { return f32_bits(x); }

struct Identity {
  float operator()(float x) const { return x; }
};

TEST(DeviceMath, ConversionsAreBitExactWithTheCpuBackend) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e30f, -1e-30f,
                           std::ldexp(1.0f, -24), std::ldexp(1.0f, -25), std::ldexp(1.5f, -25), std::ldexp(1.0f, -26),
                           std::ldexp(3.0f, -25), std::ldexp(1.0f, -14), std::ldexp(1023.5f, -24),
                           std::ldexp(1.0f, -149), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                           from_bits(0x7f800001u), from_bits(0xffc12345u)};
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) xs.push_back(from_bits(rng()));  // every exponent, NaNs included
  for (int e = -30; e <= 17; ++e)
    for (int m = 0; m < 64; ++m) xs.push_back(std::ldexp(1.0f + m / 64.0f + 1.0f / 2048.0f, e));  // ties near fp16
  for (float x : xs) {
    ASSERT_EQ(dev::to_bf16(x), cpu::to_bf16(x)) << "bf16 of bits " << std::hex << bits(x);
    ASSERT_EQ(dev::to_fp16(x), cpu::to_fp16(x)) << "fp16 of bits " << std::hex << bits(x);
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(bits(dev::from_fp16(uint16_t(h))), bits(cpu::from_fp16(uint16_t(h)))) << "fp16 bits " << h;
    ASSERT_EQ(bits(dev::from_bf16(uint16_t(h))), bits(cpu::from_bf16(uint16_t(h)))) << "bf16 bits " << h;
  }
}

TEST(DeviceMath, RopeSwigluAndAdamwElementsMatchTheCpuBackend) {
  auto be = make_cpu_backend(2);
  // RoPE, both layouts, forward and backward (accumulating), on strided heads.
  const int64_t N = 10, S = 5, heads = 3, dr = 8, in_ts = heads * dr + 3, out_ts = heads * dr;
  const FVec in = randn(size_t(N * in_ts), 1), cs = randn(size_t(S * dr / 2), 2), sn = randn(size_t(S * dr / 2), 3);
  for (bool interleave : {false, true}) {
    FVec want(size_t(N * out_ts)), got(want.size());
    be->rope_forward({want.data(), {N, heads, dr}, {out_ts, dr, 1}}, {in.data(), {N, heads, dr}, {in_ts, dr, 1}},
                     {cs.data(), {S, dr / 2}}, {sn.data(), {S, dr / 2}}, interleave);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < dr / 2; ++j) {
          const float* x = in.data() + t * in_ts + h * dr;
          float* o = got.data() + t * out_ts + h * dr;
          const float c = cs[size_t((t % S) * dr / 2 + j)], s = sn[size_t((t % S) * dr / 2 + j)];
          dev::rope_rotate(x[dev::rope_first(j, dr, interleave)], x[dev::rope_second(j, dr, interleave)], c, s, o + j,
                           o + j + dr / 2);
        }
    EXPECT_LT(max_rel_err(got, want), 1e-6) << "rope forward, interleave " << interleave;
    FVec dwant = randn(size_t(N * in_ts), 4), dgot = dwant;
    be->rope_backward({dwant.data(), {N, heads, dr}, {in_ts, dr, 1}}, {want.data(), {N, heads, dr}, {out_ts, dr, 1}},
                      {cs.data(), {S, dr / 2}}, {sn.data(), {S, dr / 2}}, interleave, true);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < dr / 2; ++j) {
          const float* g = want.data() + t * out_ts + h * dr;
          float* dx = dgot.data() + t * in_ts + h * dr;
          const float c = cs[size_t((t % S) * dr / 2 + j)], s = sn[size_t((t % S) * dr / 2 + j)];
          float da, db;
          dev::rope_rotate_back(g[j], g[j + dr / 2], c, s, &da, &db);
          dx[dev::rope_first(j, dr, interleave)] += da;
          dx[dev::rope_second(j, dr, interleave)] += db;
        }
    EXPECT_LT(max_rel_err(dgot, dwant), 1e-6) << "rope backward, interleave " << interleave;
  }
  // SwiGLU.
  const int64_t T = 7, I = 9;
  const FVec GU = randn(size_t(T * 2 * I), 5, 3.0f), dM = randn(size_t(T * I), 6);
  FVec M(size_t(T * I)), dGU(size_t(T * 2 * I)), M2(M.size()), dGU2(dGU.size());
  be->swiglu_forward({M.data(), {T, I}}, {GU.data(), {T, 2 * I}});
  be->swiglu_backward({dGU.data(), {T, 2 * I}}, {dM.data(), {T, I}}, {GU.data(), {T, 2 * I}});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const float g = GU[size_t(t * 2 * I + i)], u = GU[size_t(t * 2 * I + I + i)];
      M2[size_t(t * I + i)] = dev::swiglu(g, u);
      dev::swiglu_grad(dM[size_t(t * I + i)], g, u, &dGU2[size_t(t * 2 * I + i)], &dGU2[size_t(t * 2 * I + I + i)]);
    }
  EXPECT_LT(max_rel_err(M2, M), 1e-6);
  EXPECT_LT(max_rel_err(dGU2, dGU), 1e-6);
  // AdamW, decoupled decay and L2 forms, with a gradient scale.
  for (bool l2 : {false, true}) {
    FVec p = randn(50, 7), g = randn(50, 8), m = randn(50, 9, 0.1f), v = randn(50, 10, 0.1f);
    for (float& x : v) x = std::fabs(x);
    FVec p2 = p, m2 = m, v2 = v;
    AdamWParams a;
    a.lr = 0.01f, a.step = 7, a.grad_scale = 0.5f;
    (l2 ? a.l2 : a.weight_decay) = 0.1f;
    be->adamw({p.data(), {50}}, {g.data(), {50}}, {m.data(), {50}}, {v.data(), {50}}, a);
    const dev::AdamWConsts k = dev::adamw_consts(a);
    for (size_t i = 0; i < 50; ++i) dev::adamw_element(&p2[i], g[i], &m2[i], &v2[i], k);
    EXPECT_LT(max_rel_err(p2, p), 1e-6);
    EXPECT_LT(max_rel_err(m2, m), 1e-6);
    EXPECT_LT(max_rel_err(v2, v), 1e-6);
  }
}

RouterParams router(int64_t E, int64_t k, int64_t G, int64_t g, ScoringFunc s, TopkMethod m, bool norm, float scale,
                    bool v2) {
  RouterParams p;
  p.num_experts = E, p.top_k = k, p.n_group = G, p.topk_group = g, p.scoring = s, p.method = m;
  p.norm_topk_prob = norm, p.routed_scaling_factor = scale, p.v2_weights = v2;
  return p;
}

TEST(DeviceMath, RouterRowsSelectAndDifferentiateAsTheCpuBackend) {
  auto be = make_cpu_backend(2);
  const int64_t N = 33;
  const RouterParams cases[] = {
      router(16, 4, 4, 2, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, true, 2.5f, false),
      router(8, 3, 2, 1, ScoringFunc::kSigmoid, TopkMethod::kNoauxTc, true, 1.0f, false),
      router(6, 2, 1, 1, ScoringFunc::kSoftmax, TopkMethod::kGreedy, false, 1.0f, true),
      router(8, 3, 4, 2, ScoringFunc::kSoftmax, TopkMethod::kGroupLimitedGreedy, false, 16.0f, true),
      router(6, 3, 1, 1, ScoringFunc::kSoftmax, TopkMethod::kGreedy, true, 1.0f, true)};
  for (const RouterParams& p : cases) {
    const int64_t E = p.num_experts, k = p.top_k;
    const FVec logits = randn(size_t(N * E), 11), bias = randn(size_t(E), 12, 0.3f), dw = randn(size_t(N * k), 13),
               extra = randn(size_t(N * E), 14);
    const float* b = p.method == TopkMethod::kNoauxTc ? bias.data() : nullptr;
    std::vector<int32_t> idx(size_t(N * k)), idx2(idx.size());
    FVec w(size_t(N * k)), s(size_t(N * E)), w2(w.size()), s2(s.size()), dl(s.size()), dl2(s.size());
    be->router_forward({idx.data(), {N, p.top_k}}, {w.data(), {N, p.top_k}}, {s.data(), {N, p.num_experts}},
                       {logits.data(), {N, p.num_experts}}, {b, {p.num_experts}}, p);
    be->router_backward({dl.data(), {N, p.num_experts}}, {dw.data(), {N, p.top_k}}, {extra.data(), {N, p.num_experts}},
                        {s.data(), {N, p.num_experts}}, {idx.data(), {N, p.top_k}}, p);
    for (int64_t t = 0; t < N; ++t) {
      dev::router_forward_row<1024, 1024>(idx2.data() + t * k, w2.data() + t * k, s2.data() + t * E, logits.data() + t * E,
                                    b, p);
      dev::router_backward_row(dl2.data() + t * E, dw.data() + t * k, extra.data() + t * E, s.data() + t * E,
                                     idx.data() + t * k, p);
    }
    EXPECT_EQ(idx2, idx) << "E " << E << " k " << k;
    EXPECT_LT(max_rel_err(s2, s), 1e-6);
    EXPECT_LT(max_rel_err(w2, w), 1e-6);
    EXPECT_LT(max_rel_err(dl2, dl), 1e-6);
  }
}

// The attention rows with one lane, over every row of a (B, nh, S) problem.
template <int KIND>
void attention_rows(FVec& O, FVec& lse, FVec& dQ, FVec& dK, FVec& dV, const std::vector<dev::Storage<KIND>>& Q,
                    const std::vector<dev::Storage<KIND>>& K, const std::vector<dev::Storage<KIND>>& V,
                    const FVec& dO, const std::vector<dev::Storage<KIND>>& dO_lp, const dev::AttnShape& a) {
  FVec D(size_t(a.B * a.nh * a.S));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.nh; ++h)
      for (int64_t i = 0; i < a.S; ++i)
        dev::attention_forward_row<KIND, 1, 256>(O.data(), lse.data(), Q.data(), K.data(), V.data(), a, b, h, i, 0,
                                                 Identity{});
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.nh; ++h)
      for (int64_t i = 0; i < a.S; ++i) {
        dev::attention_rowsum<1>(D.data(), dO.data(), O.data(), a, b, h, i, 0, Identity{});
      }
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.nh; ++h)
      for (int64_t i = 0; i < a.S; ++i) {
        dev::attention_backward_dq_row<KIND, 1, 256>(dQ.data(), dO_lp.data(), Q.data(), K.data(), V.data(),
                                                     lse.data(), D.data(), a, b, h, i, 0, Identity{});
        dev::attention_backward_dkv_row<KIND, 1, 256>(dK.data(), dV.data(), dO_lp.data(), Q.data(), K.data(),
                                                      V.data(), lse.data(), D.data(), a, b, h, i, 0, Identity{});
      }
}

// The balance loss's cells, token rows and total as the CUDA kernels run them (one thread per
// (group, expert) cell, per token) against the CPU backend's moe_balance_stats / _grad: the
// same doubles summed in the same order, so equal to float rounding. Sequence groups cut by the
// call's first token, a group the call does not reach, and the one-group (batch) form.
TEST(DeviceMath, BalanceCellsAndRowsMatchTheCpuBackend) {
  auto be = make_cpu_backend(1);
  const int64_t E = 7, k = 3;
  struct Case {
    int64_t first, n, group_len, groups, T;
  };
  for (const Case c : {Case{5, 37, 16, 4, 16}, Case{0, 40, 0, 1, 40}, Case{16, 20, 16, 3, 16}}) {
    SCOPED_TRACE(::testing::Message() << "first " << c.first << ", n " << c.n << ", group_len " << c.group_len);
    Backend::BalanceShape b;
    b.n = c.n, b.k = k, b.E = E, b.first = c.first, b.group_len = c.group_len, b.groups = c.groups, b.T = c.T;
    FVec scores = randn(size_t(c.n * E), 71);
    for (float& x : scores) x = 1.0f / (1.0f + std::exp(-x));
    std::mt19937 rng(72);
    std::vector<int32_t> idx(size_t(c.n * k));
    for (int64_t i = 0; i < c.n; ++i)
      for (int64_t j = 0; j < k; ++j) idx[size_t(i * k + j)] = int32_t((i + 2 * j + int64_t(rng() % 2)) % E);
    FVec want(size_t(2 * c.groups * E)), got(want.size());
    be->moe_balance_stats({want.data(), {2, b.groups, b.E}}, {idx.data(), {b.n, b.k}}, {scores.data(), {b.n, b.E}}, b);
    std::vector<double> rowsum(size_t(c.n));
    for (int64_t i = 0; i < c.n; ++i) rowsum[size_t(i)] = dev::balance_row_sum(scores.data() + i * E, E);
    for (int64_t g = 0; g < c.groups; ++g) {
      for (int64_t e = 0; e < E; ++e) {
        double f = 0, P = 0;
        dev::balance_stats_cell(&f, &P, idx.data(), scores.data(), rowsum.data(), b, g, e);
        got[size_t(g * E + e)] = float(f);
        got[size_t(c.groups * E + g * E + e)] = float(P);
      }
    }
    EXPECT_LT(max_rel_err(got, want), 1e-6);
    double nonzero = 0;
    for (float v : want) nonzero += v != 0.0f;
    EXPECT_GT(nonzero, 0.0);
    const double weight = 0.29, grad_scale = 4.0;
    FVec dwant(size_t(c.n * E)), dgot(dwant.size());
    float aux = 0.5f;
    be->moe_balance_grad({dwant.data(), {b.n, b.E}}, {&aux, {1}}, {want.data(), {2, b.groups, b.E}},
                         {scores.data(), {b.n, b.E}}, b, weight, grad_scale);
    for (int64_t i = 0; i < c.n; ++i)
      dev::balance_grad_row(dgot.data() + i * E, want.data() + dev::balance_group_of(b, i) * E,
                            scores.data() + i * E, b, weight, grad_scale);
    EXPECT_LT(max_rel_err(dgot, dwant), 1e-6);
    EXPECT_NEAR(0.5 + dev::balance_aux_total(want.data(), b, weight), aux, 1e-6);
  }
}

TEST(DeviceMath, AttentionRowsMatchTheCpuBackendInEveryType) {
  auto be = make_cpu_backend(2);
  const dev::AttnShape a{2, 37, 3, 24, 16, 0.2f};
  const size_t nq = size_t(a.B * a.S * a.nh * a.dqk), nv = size_t(a.B * a.S * a.nh * a.dv),
               nl = size_t(a.B * a.nh * a.S);
  const FVec Q = randn(nq, 31), K = randn(nq, 32), V = randn(nv, 33), dO = randn(nv, 34);
  be->reserve_attention(a.S);
  // fp32 rows against the fp32 kernels.
  {
    FVec O(nv), lse(nl), dQ(nq), dK(nq), dV(nv), O2(nv), lse2(nl), dQ2(nq), dK2(nq), dV2(nv);
    be->attention_forward({O.data(), {a.B, a.S, a.nh, a.dv}}, {lse.data(), {a.B, a.nh, a.S}},
                          {Q.data(), {a.B, a.S, a.nh, a.dqk}}, {K.data(), {a.B, a.S, a.nh, a.dqk}},
                          {V.data(), {a.B, a.S, a.nh, a.dv}}, a.scale);
    be->attention_backward({dQ.data(), {a.B, a.S, a.nh, a.dqk}}, {dK.data(), {a.B, a.S, a.nh, a.dqk}},
                           {dV.data(), {a.B, a.S, a.nh, a.dv}}, {dO.data(), {a.B, a.S, a.nh, a.dv}}, {},
                           {Q.data(), {a.B, a.S, a.nh, a.dqk}}, {K.data(), {a.B, a.S, a.nh, a.dqk}},
                           {V.data(), {a.B, a.S, a.nh, a.dv}}, {O.data(), {a.B, a.S, a.nh, a.dv}},
                           {lse.data(), {a.B, a.nh, a.S}}, a.scale);
    attention_rows<0>(O2, lse2, dQ2, dK2, dV2, Q, K, V, dO, dO, a);
    EXPECT_LT(max_rel_err(O2, O), 1e-5);
    EXPECT_LT(max_rel_err(lse2, lse), 1e-5);
    EXPECT_LT(max_rel_err(dQ2, dQ), 1e-5);
    EXPECT_LT(max_rel_err(dK2, dK), 1e-5);
    EXPECT_LT(max_rel_err(dV2, dV), 1e-5);
  }
  // 16-bit rows against the fp32 kernels on the rounded inputs: the only differences left are
  // the rounded probabilities, score gradients and dO the 16-bit GEMMs see (bf16 ~ 2^-8, fp16 ~ 2^-11).
  for (int kind : {1, 2}) {
    auto round = [&](const FVec& x, std::vector<uint16_t>& out) {
      out.resize(x.size());
      FVec back(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        out[i] = kind == 1 ? dev::to_bf16(x[i]) : dev::to_fp16(x[i]);
        back[i] = kind == 1 ? dev::from_bf16(out[i]) : dev::from_fp16(out[i]);
      }
      return back;
    };
    std::vector<uint16_t> q16, k16, v16, do16;
    const FVec Qr = round(Q, q16), Kr = round(K, k16), Vr = round(V, v16);
    round(dO, do16);
    FVec O(nv), lse(nl), dQ(nq), dK(nq), dV(nv), O2(nv), lse2(nl), dQ2(nq), dK2(nq), dV2(nv);
    be->attention_forward({O.data(), {a.B, a.S, a.nh, a.dv}}, {lse.data(), {a.B, a.nh, a.S}},
                          {Qr.data(), {a.B, a.S, a.nh, a.dqk}}, {Kr.data(), {a.B, a.S, a.nh, a.dqk}},
                          {Vr.data(), {a.B, a.S, a.nh, a.dv}}, a.scale);
    be->attention_backward({dQ.data(), {a.B, a.S, a.nh, a.dqk}}, {dK.data(), {a.B, a.S, a.nh, a.dqk}},
                           {dV.data(), {a.B, a.S, a.nh, a.dv}}, {dO.data(), {a.B, a.S, a.nh, a.dv}}, {},
                           {Qr.data(), {a.B, a.S, a.nh, a.dqk}}, {Kr.data(), {a.B, a.S, a.nh, a.dqk}},
                           {Vr.data(), {a.B, a.S, a.nh, a.dv}}, {O.data(), {a.B, a.S, a.nh, a.dv}},
                           {lse.data(), {a.B, a.nh, a.S}}, a.scale);
    if (kind == 1) attention_rows<1>(O2, lse2, dQ2, dK2, dV2, q16, k16, v16, dO, do16, a);
    else attention_rows<2>(O2, lse2, dQ2, dK2, dV2, q16, k16, v16, dO, do16, a);
    const double tol = kind == 1 ? 2e-2 : 3e-3;
    EXPECT_LT(max_rel_err(lse2, lse), 1e-5) << "kind " << kind;  // lse is fp32 on fp32 scores either way
    EXPECT_LT(max_rel_err(O2, O), tol) << "kind " << kind;
    EXPECT_LT(max_rel_err(dQ2, dQ), tol) << "kind " << kind;
    EXPECT_LT(max_rel_err(dK2, dK), tol) << "kind " << kind;
    EXPECT_LT(max_rel_err(dV2, dV), tol) << "kind " << kind;
    // and they are not merely within tolerance by accident: the rounding shows.
    EXPECT_GT(max_rel_err(O2, O), 1e-7) << "kind " << kind;
  }
}

// The tensor-core attention kernels (attention_tiles.cu, "tiled") emulated on the host, block by
// block and warp by warp as the GPU runs them: the same tile geometry, lane mapping, masking and
// rounding (device_math.h's flash_* functions), with the MMAs replaced by loops summing the
// 16-bit products in fp32. Only the MMA fragments themselves are left to the GPU check.
using U16 = std::vector<uint16_t>;
constexpr int kRows = dev::kFlashRows, kCols = dev::kFlashCols, kLdS = dev::kFlashLdS, kLdP = dev::kFlashLdP;

template <int KIND>
float widen(uint16_t v) {
  return KIND == 1 ? dev::from_bf16(v) : dev::from_fp16(v);
}
void tile_load(U16& tile, int ld, const uint16_t* src, int64_t stride, int64_t first, int n, int64_t S, int d) {
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < d; ++c) tile[size_t(r * ld + c)] = first + r < S ? src[(first + r) * stride + c] : 0;
}
// S[16 x kCols] = A[16 x d] B[kCols x d]^T.
template <int KIND>
void tile_scores(float* S, const uint16_t* A, int lda, const uint16_t* B, int ldb, int d) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < kCols; ++c) {
      float acc = 0;
      for (int k = 0; k < d; ++k) acc += widen<KIND>(A[r * lda + k]) * widen<KIND>(B[c * ldb + k]);
      S[r * kLdS + c] = acc;
    }
}
// C[16 x n] += P[16 x kCols] X[kCols x n].
template <int KIND>
void tile_accumulate(float* C, int ldc, const uint16_t* P, const uint16_t* X, int ldx, int n) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < n; ++c) {
      float acc = C[r * ldc + c];
      for (int k = 0; k < kCols; ++k) acc += widen<KIND>(P[r * kLdP + k]) * widen<KIND>(X[k * ldx + c]);
      C[r * ldc + c] = acc;
    }
}

template <int KIND>
void attention_tiles(FVec& O, FVec& lse, FVec& dQ, FVec& dK, FVec& dV, const U16& Q, const U16& K, const U16& V,
                     const FVec& dO, const U16& dO16, const dev::AttnShape& a) {
  const int dqk = int(a.dqk), dv = int(a.dv), ldq = dqk + 8, ldv = dv + 8;
  const int64_t qs = a.nh * a.dqk, vs = a.nh * a.dv, blocks = (a.S + kRows - 1) / kRows;
  U16 Qs(size_t(kRows * ldq)), Ks(size_t(kRows * ldq)), Vs(size_t(kRows * ldv)), Gs(size_t(kRows * ldv));
  FVec Ss(16 * kLdS), Ps(16 * kLdS), acc_k(size_t(16 * (dqk + 4))), acc_v(size_t(16 * (dv + 4)));
  U16 P16(16 * kLdP), dS16(16 * kLdP);
  float s[32][dev::kFlashLane], dp[32][dev::kFlashLane];
  FVec D(size_t(a.B * a.nh * a.S));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.nh; ++h) {
      const uint16_t *Qb = Q.data() + b * a.S * qs + h * a.dqk, *Kb = K.data() + b * a.S * qs + h * a.dqk;
      const uint16_t *Vb = V.data() + b * a.S * vs + h * a.dv, *Gb = dO16.data() + b * a.S * vs + h * a.dv;
      float* Lb = lse.data() + (b * a.nh + h) * a.S;
      for (int64_t blk = 0; blk < blocks; ++blk) {  // forward
        const int64_t i0 = blk * kRows, tiles = dev::flash_key_tiles(i0, a.S);
        tile_load(Qs, ldq, Qb, qs, i0, kRows, a.S, dqk);
        for (int w = 0; w < 4; ++w) {
          const int64_t r0 = i0 + 16 * w;
          float m[32], l[32], L[32];
          for (int lane = 0; lane < 32; ++lane) m[lane] = dev::neg_inf(), l[lane] = 0;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t j0 = t * kCols;
            tile_load(Ks, ldq, Kb, qs, j0, kCols, a.S, dqk);
            if (!dev::flash_query_warp_sees(r0, j0, a.S)) continue;
            tile_scores<KIND>(Ss.data(), Qs.data() + 16 * w * ldq, ldq, Ks.data(), ldq, dqk);
            for (int lane = 0; lane < 32; ++lane) {
              const int64_t i = r0 + dev::flash_lane_row(lane);
              dev::flash_read_lane(s[lane], Ss.data(), lane);
              if (i < a.S) dev::flash_stats_lane(s[lane], lane, i, j0, a.scale, m[lane], l[lane]);
            }
          }
          for (int lane = 0; lane < 16; ++lane) {
            float mm = m[lane], ll = l[lane];
            dev::flash_merge(mm, ll, m[lane + 16], l[lane + 16]);
            L[lane] = L[lane + 16] = mm + std::log(ll);
          }
          std::fill(acc_v.begin(), acc_v.end(), 0.0f);
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t j0 = t * kCols;
            tile_load(Ks, ldq, Kb, qs, j0, kCols, a.S, dqk);
            tile_load(Vs, ldv, Vb, vs, j0, kCols, a.S, dv);
            if (!dev::flash_query_warp_sees(r0, j0, a.S)) continue;
            tile_scores<KIND>(Ss.data(), Qs.data() + 16 * w * ldq, ldq, Ks.data(), ldq, dqk);
            for (int lane = 0; lane < 32; ++lane) dev::flash_read_lane(s[lane], Ss.data(), lane);
            for (int lane = 0; lane < 32; ++lane)
              dev::flash_probs_lane<KIND>(P16.data(), s[lane], lane, r0 + dev::flash_lane_row(lane), j0, a.S,
                                          a.scale, L[lane]);
            tile_accumulate<KIND>(acc_v.data(), dv + 4, P16.data(), Vs.data(), ldv, dv);
          }
          for (int r = 0; r < 16 && r0 + r < a.S; ++r) {
            for (int c = 0; c < dv; ++c) O[size_t((b * a.S + r0 + r) * vs + h * a.dv + c)] = acc_v[size_t(r * (dv + 4) + c)];
            Lb[r0 + r] = L[r];
          }
        }
      }
      for (int64_t i = 0; i < a.S; ++i) dev::attention_rowsum<1>(D.data(), dO.data(), O.data(), a, b, h, i, 0, Identity{});
      const float* Db = D.data() + (b * a.nh + h) * a.S;
      for (int64_t blk = 0; blk < blocks; ++blk) {  // dQ
        const int64_t i0 = blk * kRows, tiles = dev::flash_key_tiles(i0, a.S);
        tile_load(Qs, ldq, Qb, qs, i0, kRows, a.S, dqk);
        tile_load(Gs, ldv, Gb, vs, i0, kRows, a.S, dv);
        for (int w = 0; w < 4; ++w) {
          const int64_t r0 = i0 + 16 * w;
          std::fill(acc_k.begin(), acc_k.end(), 0.0f);
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t j0 = t * kCols;
            tile_load(Ks, ldq, Kb, qs, j0, kCols, a.S, dqk);
            tile_load(Vs, ldv, Vb, vs, j0, kCols, a.S, dv);
            if (!dev::flash_query_warp_sees(r0, j0, a.S)) continue;
            tile_scores<KIND>(Ss.data(), Qs.data() + 16 * w * ldq, ldq, Ks.data(), ldq, dqk);
            tile_scores<KIND>(Ps.data(), Gs.data() + 16 * w * ldv, ldv, Vs.data(), ldv, dv);
            for (int lane = 0; lane < 32; ++lane) {
              dev::flash_read_lane(s[lane], Ss.data(), lane);
              dev::flash_read_lane(dp[lane], Ps.data(), lane);
            }
            for (int lane = 0; lane < 32; ++lane) {
              const int64_t i = r0 + dev::flash_lane_row(lane);
              dev::flash_dq_lane<KIND>(dS16.data(), s[lane], dp[lane], lane, i, j0, a.S, a.scale,
                                       i < a.S ? Lb[i] : 0.0f, i < a.S ? Db[i] : 0.0f);
            }
            tile_accumulate<KIND>(acc_k.data(), dqk + 4, dS16.data(), Ks.data(), ldq, dqk);
          }
          for (int r = 0; r < 16 && r0 + r < a.S; ++r)
            for (int c = 0; c < dqk; ++c)
              dQ[size_t((b * a.S + r0 + r) * qs + h * a.dqk + c)] = acc_k[size_t(r * (dqk + 4) + c)];
        }
      }
      for (int64_t blk = 0; blk < blocks; ++blk) {  // dK, dV
        const int64_t j0 = blk * kRows;
        tile_load(Ks, ldq, Kb, qs, j0, kRows, a.S, dqk);
        tile_load(Vs, ldv, Vb, vs, j0, kRows, a.S, dv);
        for (int w = 0; w < 4; ++w) {
          const int64_t r0 = j0 + 16 * w;
          if (!dev::flash_key_warp_sees(r0, a.S)) continue;
          std::fill(acc_k.begin(), acc_k.end(), 0.0f);
          std::fill(acc_v.begin(), acc_v.end(), 0.0f);
          for (int64_t i0 = j0; i0 < a.S; i0 += kCols) {
            tile_load(Qs, ldq, Qb, qs, i0, kCols, a.S, dqk);
            tile_load(Gs, ldv, Gb, vs, i0, kCols, a.S, dv);
            float Lt[kCols], Dt[kCols];
            for (int c = 0; c < kCols; ++c) Lt[c] = i0 + c < a.S ? Lb[i0 + c] : 0.0f, Dt[c] = i0 + c < a.S ? Db[i0 + c] : 0.0f;
            tile_scores<KIND>(Ss.data(), Ks.data() + 16 * w * ldq, ldq, Qs.data(), ldq, dqk);
            tile_scores<KIND>(Ps.data(), Vs.data() + 16 * w * ldv, ldv, Gs.data(), ldv, dv);
            for (int lane = 0; lane < 32; ++lane) {
              dev::flash_read_lane(s[lane], Ss.data(), lane);
              dev::flash_read_lane(dp[lane], Ps.data(), lane);
            }
            for (int lane = 0; lane < 32; ++lane)
              dev::flash_dkv_lane<KIND>(P16.data(), dS16.data(), s[lane], dp[lane], lane,
                                        r0 + dev::flash_lane_row(lane), i0, a.S, a.scale, Lt, Dt);
            tile_accumulate<KIND>(acc_v.data(), dv + 4, P16.data(), Gs.data(), ldv, dv);
            tile_accumulate<KIND>(acc_k.data(), dqk + 4, dS16.data(), Qs.data(), ldq, dqk);
          }
          for (int r = 0; r < 16 && r0 + r < a.S; ++r) {
            for (int c = 0; c < dqk; ++c)
              dK[size_t((b * a.S + r0 + r) * qs + h * a.dqk + c)] = acc_k[size_t(r * (dqk + 4) + c)];
            for (int c = 0; c < dv; ++c)
              dV[size_t((b * a.S + r0 + r) * vs + h * a.dv + c)] = acc_v[size_t(r * (dv + 4) + c)];
          }
        }
      }
    }
}

// The tiles give the rows' results (the GPU's reference kernels, checked against the CPU
// backend above) up to the order of fp32 sums: over several key and query tiles, with rows and
// keys past the sequence in the last ones, and heads of different widths.
TEST(DeviceMath, AttentionTilesMatchTheRows) {
  for (const dev::AttnShape& a : {dev::AttnShape{2, 70, 2, 48, 32, 0.15f}, dev::AttnShape{1, 150, 1, 32, 16, 0.2f},
                                  dev::AttnShape{1, 64, 3, 16, 48, 0.25f}}) {
    const size_t nq = size_t(a.B * a.S * a.nh * a.dqk), nv = size_t(a.B * a.S * a.nh * a.dv),
                 nl = size_t(a.B * a.nh * a.S);
    const FVec Qf = randn(nq, 41), Kf = randn(nq, 42), Vf = randn(nv, 43), dO = randn(nv, 44);
    for (int kind : {1, 2}) {
      const auto round = [&](const FVec& x) {
        U16 out(x.size());
        for (size_t i = 0; i < x.size(); ++i) out[i] = kind == 1 ? dev::to_bf16(x[i]) : dev::to_fp16(x[i]);
        return out;
      };
      const U16 Q = round(Qf), K = round(Kf), V = round(Vf), dO16 = round(dO);
      FVec O(nv), lse(nl), dQ(nq), dK(nq), dV(nv), O2(nv, -7.0f), lse2(nl, -7.0f), dQ2(nq, -7.0f), dK2(nq, -7.0f),
          dV2(nv, -7.0f);
      if (kind == 1) {
        attention_rows<1>(O, lse, dQ, dK, dV, Q, K, V, dO, dO16, a);
        attention_tiles<1>(O2, lse2, dQ2, dK2, dV2, Q, K, V, dO, dO16, a);
      } else {
        attention_rows<2>(O, lse, dQ, dK, dV, Q, K, V, dO, dO16, a);
        attention_tiles<2>(O2, lse2, dQ2, dK2, dV2, Q, K, V, dO, dO16, a);
      }
      const std::string what = "kind " + std::to_string(kind) + " S " + std::to_string(a.S);
      const double tol = kind == 1 ? 1e-2 : 2e-3;
      EXPECT_LT(max_rel_err(lse2, lse), 1e-6) << what;
      EXPECT_LT(max_rel_err(O2, O), tol) << what;
      EXPECT_LT(max_rel_err(dQ2, dQ), tol) << what;
      EXPECT_LT(max_rel_err(dK2, dK), tol) << what;
      EXPECT_LT(max_rel_err(dV2, dV), tol) << what;
      std::printf("%s: O %.2e dQ %.2e dK %.2e dV %.2e lse %.2e\n", what.c_str(), max_rel_err(O2, O),
                  max_rel_err(dQ2, dQ), max_rel_err(dK2, dK), max_rel_err(dV2, dV), max_rel_err(lse2, lse));
    }
  }
}

}  // namespace
}  // namespace dstrain::kernels

namespace dstrain::kernels {
namespace {

// The device-memory check (kernels/cpu/device_check.cpp): what the engine's device-cleanliness
// tests rely on.
TEST(DeviceCheck, ItsMemoryIsNotHostMemoryAndItsOpsRefuseHostPointers) {
  auto be = make_device_check_backend(make_cpu_backend(1));
  EXPECT_FALSE(be->host_addressable());
  EXPECT_TRUE(make_cpu_backend(1)->host_addressable());
  DeviceBuffer a(*be, 16 * 4), b(*be, 16 * 4);
  EXPECT_NE(reinterpret_cast<uintptr_t>(a.data()) & (uintptr_t(1) << 62), 0u);
  FVec x = randn(16, 40), y(16), host(16);
  be->copy_from_host(a.data(), x.data(), 16 * 4);
  be->fill({b.as<float>(), {16}}, 0.5f);
  be->add({b.as<float>(), {16}}, {a.as<float>(), {16}});
  be->copy_to_host(y.data(), b.data(), 16 * 4);
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(y[i], x[i] + 0.5f);
  DeviceArray<double> s(*be, 1);
  be->sum_squares({s.data(), {1}}, {a.as<float>(), {16}}, false);
  double got = 0, want = 0;
  be->copy_to_host(&got, s.data(), 8);
  for (float v : x) want += double(v) * v;
  EXPECT_NEAR(got, want, 1e-12 * want);
  // A host pointer where device memory belongs is refused, naming the op.
  try {
    be->add({host.data(), {16}}, {a.as<float>(), {16}});
    ADD_FAILURE() << "a host pointer was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("add: a host pointer"), std::string::npos) << e.what();
  }
  // And the host cannot read device memory directly: the access faults.
  float* dev = a.as<float>();
  EXPECT_DEATH({ std::printf("%f\n", static_cast<volatile float*>(dev)[3]); }, "");
}


// Every block the check hands out is poisoned (0xFF bytes: NaN in fp32, bf16 and fp16; -1 as an
// int32), the first time and again when a freed block is reused — memory nothing wrote reads
// as NaN, as the CUDA pool's dirty blocks would, not as the zeros of fresh pages.
TEST(DeviceCheck, EveryBlockHandedOutIsPoisonedFreshOrReused) {
  auto be = make_device_check_backend(make_cpu_backend(1));
  const int64_t n = 1000;
  std::vector<uint32_t> bits(static_cast<size_t>(n));
  void* first = nullptr;
  {
    DeviceBuffer a(*be, n * 4);
    first = a.data();
    be->copy_to_host(bits.data(), a.data(), n * 4);
    for (uint32_t b : bits) ASSERT_EQ(b, 0xFFFFFFFFu);
    float f = 0;
    be->copy_to_host(&f, a.data(), 4);
    EXPECT_TRUE(std::isnan(f));
    be->fill({a.as<float>(), {n}}, 2.0f);  // written, then freed
  }
  DeviceBuffer b(*be, n * 4 - 100);  // the same size class: the cached block again
  EXPECT_EQ(b.data(), first);
  be->copy_to_host(bits.data(), b.data(), (n * 4 - 100) / 4 * 4);
  for (int64_t i = 0; i < (n * 4 - 100) / 4; ++i) ASSERT_EQ(bits[size_t(i)], 0xFFFFFFFFu) << i;
  uint16_t half = 0;
  be->copy_to_host(&half, b.data(), 2);
  EXPECT_EQ(half, 0xFFFFu);  // a NaN as bf16 and as fp16
}

// A block freed while an operation elsewhere (a communicator's stream) still uses it — recorded
// through record_use, at any address inside the block — is not handed out again until that
// operation has finished; then it is.
struct FakeUse final : StreamUse {
  bool done = false;
  bool finished() override { return done; }
};
TEST(DeviceCheck, AFreedBlockAnOperationStillUsesIsNotReusedUntilItFinishes) {
  auto be = make_device_check_backend(make_cpu_backend(1));
  auto use = std::make_shared<FakeUse>();
  void* held = nullptr;
  {
    DeviceBuffer a(*be, 4096);
    held = a.data();
    be->record_use(a.as<char>() + 1000, use);  // an interior pointer: the block holding it
    be->record_use(&use, use);                 // a host pointer: ignored
  }
  DeviceBuffer b(*be, 4096);
  EXPECT_NE(b.data(), held) << "a block an unfinished operation uses was handed out";
  use->done = true;
  DeviceBuffer c(*be, 4096);
  EXPECT_EQ(c.data(), held) << "the block once its operation finished";
}

}  // namespace
}  // namespace dstrain::kernels
