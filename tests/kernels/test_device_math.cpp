// The CUDA backend's per-element and per-row math (kernels/cuda/device_math.h), compiled here by
// the host compiler, against the CPU backend: conversions bit for bit over special and random
// values, RoPE / SwiGLU / AdamW elements, router rows, and the attention rows run with one lane
// (the GPU runs the same functions with 32) — forward, D, dQ and dK/dV, fp32 to 1e-5 and the
// 16-bit rows against fp32 attention on the rounded inputs. Runs on every machine, GPU or not.
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
    be->rope_forward(want.data(), out_ts, dr, in.data(), in_ts, dr, cs.data(), sn.data(), N, S, heads, dr, interleave);
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
    be->rope_backward(dwant.data(), in_ts, dr, want.data(), out_ts, dr, cs.data(), sn.data(), N, S, heads, dr,
                      interleave, true);
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
  be->swiglu_forward(M.data(), GU.data(), T, I);
  be->swiglu_backward(dGU.data(), dM.data(), GU.data(), T, I);
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
    be->adamw(p.data(), g.data(), m.data(), v.data(), 50, a);
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
    be->router_forward(idx.data(), w.data(), s.data(), logits.data(), b, N, p);
    be->router_backward(dl.data(), dw.data(), extra.data(), s.data(), idx.data(), N, p);
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
    be->attention_forward(O.data(), lse.data(), Q.data(), K.data(), V.data(), a.B, a.S, a.nh, a.dqk, a.dv, a.scale);
    be->attention_backward(dQ.data(), dK.data(), dV.data(), dO.data(), Q.data(), K.data(), V.data(), O.data(),
                           lse.data(), a.B, a.S, a.nh, a.dqk, a.dv, a.scale);
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
    be->attention_forward(O.data(), lse.data(), Qr.data(), Kr.data(), Vr.data(), a.B, a.S, a.nh, a.dqk, a.dv, a.scale);
    be->attention_backward(dQ.data(), dK.data(), dV.data(), dO.data(), Qr.data(), Kr.data(), Vr.data(), O.data(),
                           lse.data(), a.B, a.S, a.nh, a.dqk, a.dv, a.scale);
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
  be->fill(b.as<float>(), 0.5f, 16);
  be->add(b.as<float>(), a.as<float>(), 16);
  be->copy_to_host(y.data(), b.data(), 16 * 4);
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(y[i], x[i] + 0.5f);
  DeviceArray<double> s(*be, 1);
  be->sum_squares(s.data(), a.as<float>(), 16, false);
  double got = 0, want = 0;
  be->copy_to_host(&got, s.data(), 8);
  for (float v : x) want += double(v) * v;
  EXPECT_NEAR(got, want, 1e-12 * want);
  // A host pointer where device memory belongs is refused, naming the op.
  try {
    be->add(host.data(), a.as<float>(), 16);
    ADD_FAILURE() << "a host pointer was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("add: a host pointer"), std::string::npos) << e.what();
  }
  // And the host cannot read device memory directly: the access faults.
  float* dev = a.as<float>();
  EXPECT_DEATH({ std::printf("%f\n", static_cast<volatile float*>(dev)[3]); }, "");
}

}  // namespace
}  // namespace dstrain::kernels
