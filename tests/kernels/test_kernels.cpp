// Every CPU kernel against a naive reference on odd shapes (float, through the Backend), and
// every backward against central finite differences (the kernels instantiated in double).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "kernels/cpu/blas_gemm.h"
#include "kernels/cpu/cpu_ops.h"

namespace dstrain::kernels {
namespace {

using Vec = std::vector<double>;
using FVec = std::vector<float>;

Vec randn(size_t n, uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  Vec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
FVec to_f(const Vec& v) { return FVec(v.begin(), v.end()); }

double max_rel_err(const FVec& got, const Vec& want) {
  double scale = 1e-12, err = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(got[i] - want[i]));
  return err / scale;
}

// Central finite differences of loss(x) against an analytic gradient; both in double.
void expect_gradient(const std::function<double(const Vec&)>& loss, Vec x, const Vec& analytic,
                     const char* what, double tol = 1e-6) {
  ASSERT_EQ(x.size(), analytic.size());
  const double h = 1e-6;
  double worst = 0, scale = 1e-12;
  for (double a : analytic) scale = std::max(scale, std::fabs(a));
  for (size_t i = 0; i < x.size(); ++i) {
    const double orig = x[i];
    x[i] = orig + h;
    const double up = loss(x);
    x[i] = orig - h;
    const double down = loss(x);
    x[i] = orig;
    worst = std::max(worst, std::fabs((up - down) / (2 * h) - analytic[i]));
  }
  EXPECT_LT(worst / scale, tol) << what << ": worst gradient error " << worst << " (scale " << scale << ")";
}

double dot(const Vec& a, const Vec& b) { return std::inner_product(a.begin(), a.end(), b.begin(), 0.0); }

// The vectorisable exp used by softmax, sigmoid and cross-entropy against libm.
TEST(VectorExp, WithinTwoUlpOfLibmAndPropagatesNan) {
  double worst = 0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.0f + 175.0f * float(i) / 200000.0f;
    const double want = std::exp(double(x));
    worst = std::max(worst, std::fabs(cpu::vexp(x) - want) / want);
  }
  EXPECT_LT(worst, 2.5e-7);
  EXPECT_EQ(cpu::vexp(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(cpu::vexp(std::nanf(""))));
  EXPECT_LT(cpu::vexp(-1e30f), 1e-37f);
}

class Kernels : public ::testing::TestWithParam<GemmLibrary> {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend(2, GetParam());
};

TEST_P(Kernels, GemmAllTransposesOddShapes) {
  for (int ta = 0; ta < 2; ++ta) {
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t M = 7, N = 13, K = 5;
      const Vec A = randn(M * K, 1), B = randn(K * N, 2), C0 = randn(M * N, 3);
      Vec want(M * N);
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k)
            s += (ta ? A[k * M + i] : A[i * K + k]) * (tb ? B[j * K + k] : B[k * N + j]);
          want[i * N + j] = 1.5 * s + 0.5 * C0[i * N + j];
        }
      FVec C = to_f(C0);
      be->gemm({C.data(), {M, N}}, {to_f(A).data(), ta ? dstrain::kernels::Dims{K, M} : dstrain::kernels::Dims{M, K}},
               {to_f(B).data(), tb ? dstrain::kernels::Dims{N, K} : dstrain::kernels::Dims{K, N}}, ta, tb, 1.5f, 0.5f);
      EXPECT_LT(max_rel_err(C, want), 1e-6) << "ta " << ta << " tb " << tb;
    }
  }
}

TEST_P(Kernels, GroupedGemmEqualsSeparateGemms) {
  const int64_t N = 9, K = 6, count = 7;
  std::vector<FVec> A, B, C, Cref;
  std::vector<int64_t> M, Ns(count, N), Ks(count, K);
  for (int64_t i = 0; i < count; ++i) {
    M.push_back(i % 3 == 0 ? 0 : 3 + i);  // empty experts happen
    A.push_back(to_f(randn(M.back() * K, 10 + i)));
    B.push_back(to_f(randn(N * K, 20 + i)));
    C.push_back(FVec(M.back() * N, 1.0f));
    Cref.push_back(C.back());
    be->gemm({Cref.back().data(), {M.back(), N}}, {A.back().data(), {M.back(), K}}, {B.back().data(), {N, K}}, false,
             true, 1.0f, 1.0f);
  }
  std::vector<float*> c;
  std::vector<const float*> a, b;
  for (int64_t i = 0; i < count; ++i) c.push_back(C[i].data()), a.push_back(A[i].data()), b.push_back(B[i].data());
  be->gemm_grouped(gemm_problems(c.data(), reinterpret_cast<const void* const*>(a.data()), reinterpret_cast<const void* const*>(b.data()), DType::kF32, M.data(), Ns.data(), Ks.data(), count, false, true), false, true, 1.0f, 1.0f);
  for (int64_t i = 0; i < count; ++i) EXPECT_EQ(C[i], Cref[i]);
}

TEST_P(Kernels, RmsNormForward) {
  const int64_t rows = 5, C = 37;
  const Vec x = randn(rows * C, 4), w = randn(C, 5);
  Vec want(rows * C);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t c = 0; c < C; ++c) ms += x[r * C + c] * x[r * C + c] / C;
    for (int64_t c = 0; c < C; ++c) want[r * C + c] = w[c] * x[r * C + c] / std::sqrt(ms + 1e-6);
  }
  FVec y(rows * C), rstd(rows);
  be->rmsnorm_forward({y.data(), {rows, C}}, {rstd.data(), {rows}}, {to_f(x).data(), {rows, C}}, {to_f(w).data(), {C}},
                      1e-6f);
  EXPECT_LT(max_rel_err(y, want), 1e-6);
}

TEST(KernelGradients, RmsNorm) {
  const int64_t rows = 3, C = 11;
  const Vec x = randn(rows * C, 6), w = randn(C, 7), R = randn(rows * C, 8);
  const auto loss_x = [&](const Vec& xx) {
    Vec y(rows * C), rs(rows);
    cpu::rmsnorm_forward(y.data(), rs.data(), xx.data(), w.data(), rows, C, 1e-6);
    return dot(y, R);
  };
  const auto loss_w = [&](const Vec& ww) {
    Vec y(rows * C), rs(rows);
    cpu::rmsnorm_forward(y.data(), rs.data(), x.data(), ww.data(), rows, C, 1e-6);
    return dot(y, R);
  };
  Vec y(rows * C), rs(rows), dx(rows * C), dw(C, 0.0);
  cpu::rmsnorm_forward(y.data(), rs.data(), x.data(), w.data(), rows, C, 1e-6);
  cpu::rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rs.data(), rows, C);
  expect_gradient(loss_x, x, dx, "rmsnorm dx");
  expect_gradient(loss_w, w, dw, "rmsnorm dw");
}

std::pair<Vec, Vec> rope_tables(int64_t S, int64_t dr, double theta) {
  Vec c(S * dr / 2), s(S * dr / 2);
  for (int64_t p = 0; p < S; ++p)
    for (int64_t j = 0; j < dr / 2; ++j) {
      const float inv = 1.0f / std::pow(float(theta), float(2 * j) / float(dr));
      const float ang = float(p) * inv;
      c[p * dr / 2 + j] = std::cos(ang);
      s[p * dr / 2 + j] = std::sin(ang);
    }
  return {c, s};
}

// docs/model.md §3.4.1's worked example.
TEST_P(Kernels, RopeWorkedExample) {
  const auto [c, s] = rope_tables(3, 4, 10000.0);
  const FVec x = {1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4};  // positions 0, 1, 2
  FVec out(12);
  be->rope_forward({out.data(), {3, 1, 4}, {4, 0, 1}}, {x.data(), {3, 1, 4}, {4, 0, 1}}, {to_f(c).data(), {3, 4 / 2}},
                   {to_f(s).data(), {3, 4 / 2}}, true);
  const float want[12] = {1, 3, 2, 4, -1.1426397f, 2.9598507f, 1.9220756f, 4.0297995f,
                          -2.2347417f, 2.9194054f, 0.0770038f, 4.0591960f};
  for (int i = 0; i < 12; ++i) EXPECT_NEAR(out[i], want[i], 2e-6) << i;
}

// in_hs = 0 (MLA's shared rope key): the heads' gradients added in one row, equal to the sum of
// the per-head rows; the misuses (no accumulate, overlapping rows) throw and leave din as it was.
TEST_P(Kernels, RopeBackwardSharedRowAndRefusedStrides) {
  const int64_t N = 5, S = 5, heads = 3, dr = 8;
  const auto [c, s] = rope_tables(S, dr, 10000.0);
  const FVec cf = to_f(c), sf = to_f(s);
  const FVec dout = to_f(randn(N * heads * dr, 31)), base = to_f(randn(N * dr, 32));
  FVec per_head(N * heads * dr, 0.0f);
  be->rope_backward({per_head.data(), {N, heads, dr}, {heads * dr, dr, 1}},
                    {dout.data(), {N, heads, dr}, {heads * dr, dr, 1}}, {cf.data(), {S, dr / 2}},
                    {sf.data(), {S, dr / 2}}, true, false);
  FVec shared = base;
  be->rope_backward({shared.data(), {N, heads, dr}, {dr, 0, 1}}, {dout.data(), {N, heads, dr}, {heads * dr, dr, 1}},
                    {cf.data(), {S, dr / 2}}, {sf.data(), {S, dr / 2}}, true, true);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < dr; ++j) {
      float want = base[size_t(t * dr + j)];
      for (int64_t h = 0; h < heads; ++h) want += per_head[size_t(t * heads * dr + h * dr + j)];
      EXPECT_FLOAT_EQ(shared[size_t(t * dr + j)], want) << t << " " << j;
    }
  FVec untouched = base;
  EXPECT_THROW(be->rope_backward({untouched.data(), {N, heads, dr}, {dr, 0, 1}},
                                 {dout.data(), {N, heads, dr}, {heads * dr, dr, 1}}, {cf.data(), {S, dr / 2}},
                                 {sf.data(), {S, dr / 2}}, true, false),
               std::invalid_argument);
  EXPECT_THROW(be->rope_backward({untouched.data(), {N, heads, dr}, {dr, dr / 2, 1}},
                                 {dout.data(), {N, heads, dr}, {heads * dr, dr, 1}}, {cf.data(), {S, dr / 2}},
                                 {sf.data(), {S, dr / 2}}, true, true),
               std::invalid_argument);
  EXPECT_EQ(untouched, base);
}

TEST(KernelGradients, RopeBothLayouts) {
  const int64_t N = 6, S = 3, heads = 2, dr = 8;
  const auto tables = rope_tables(S, dr, 10000.0);
  const Vec& c = tables.first;  // (named, not bound: the lambda below captures them)
  const Vec& s = tables.second;
  for (bool interleave : {true, false}) {
    const Vec x = randn(N * heads * dr, 9), R = randn(N * heads * dr, 10);
    const auto loss = [&](const Vec& xx) {
      Vec out(N * heads * dr);
      cpu::rope_forward(out.data(), heads * dr, dr, xx.data(), heads * dr, dr, c.data(), s.data(),
                        N, S, heads, dr, interleave);
      return dot(out, R);
    };
    Vec dx(N * heads * dr);
    cpu::rope_backward(dx.data(), heads * dr, dr, R.data(), heads * dr, dr, c.data(), s.data(), N,
                       S, heads, dr, interleave, false);
    expect_gradient(loss, x, dx, interleave ? "rope interleaved" : "rope half");
  }
}

// Naive causal attention: the full score matrix, then softmax.
Vec naive_attention(const Vec& Q, const Vec& K, const Vec& V, int64_t B, int64_t S, int64_t nh,
                    int64_t dqk, int64_t dv, double scale) {
  Vec O(B * S * nh * dv, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < S; ++i) {
        Vec p(S, 0.0);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double sc = 0;
          for (int64_t d = 0; d < dqk; ++d)
            sc += Q[((b * S + i) * nh + h) * dqk + d] * K[((b * S + j) * nh + h) * dqk + d];
          p[j] = sc * scale;
          mx = std::max(mx, p[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int64_t j = 0; j <= i; ++j)
          for (int64_t d = 0; d < dv; ++d)
            O[((b * S + i) * nh + h) * dv + d] += p[j] / sum * V[((b * S + j) * nh + h) * dv + d];
      }
  return O;
}

// Attention on longer sequences than the backend reserved scratch for is refused, not a
// buffer overrun (ops never allocate).
TEST_P(Kernels, AttentionNeedsItsWorkspaceReserved) {
  const int64_t S = 4096, B = 1, nh = 1, d = 2;
  FVec q(B * S * nh * d, 0.1f), o(q.size()), lse(B * nh * S);
  EXPECT_THROW(be->attention_forward({o.data(), {B, S, nh, d}}, {lse.data(), {B, nh, S}}, {q.data(), {B, S, nh, d}},
                                     {q.data(), {B, S, nh, d}}, {q.data(), {B, S, nh, d}}, 1.0f),
               std::invalid_argument);
}

TEST_P(Kernels, AttentionForward) {
  for (const int64_t S : {9, 150}) {  // one partial query tile; several tiles, the last partial
  const int64_t B = 2, nh = 3, dqk = 7, dv = 5;
  const Vec Q = randn(B * S * nh * dqk, 11), K = randn(B * S * nh * dqk, 12), V = randn(B * S * nh * dv, 13);
  const double scale = 1.0 / std::sqrt(double(dqk));
  FVec O(B * S * nh * dv), lse(B * nh * S);
  be->reserve_attention(S);
  be->attention_forward({O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, {to_f(Q).data(), {B, S, nh, dqk}},
                        {to_f(K).data(), {B, S, nh, dqk}}, {to_f(V).data(), {B, S, nh, dv}}, float(scale));
  EXPECT_LT(max_rel_err(O, naive_attention(Q, K, V, B, S, nh, dqk, dv, scale)), 1e-5) << "S " << S;
  }
}

TEST(KernelGradients, Attention) {
  for (const int64_t S : {5, 70}) {  // within one query tile, and across two
  const int64_t B = S > 64 ? 1 : 2, nh = 2, dqk = 4, dv = 3;
  const double scale = 0.7;
  const Vec Q = randn(B * S * nh * dqk, 14), K = randn(B * S * nh * dqk, 15),
            V = randn(B * S * nh * dv, 16), R = randn(B * S * nh * dv, 17);
  const int threads = omp_get_max_threads();
  Vec ws(size_t(cpu::attention_workspace_floats(S, threads)));
  const auto run = [&](const Vec& q, const Vec& k, const Vec& v) {
    Vec O(B * S * nh * dv), lse(B * nh * S);
    cpu::attention_forward(O.data(), lse.data(), q.data(), k.data(), v.data(), B, S, nh, dqk, dv, scale, ws.data(),
                           threads);
    return std::make_pair(O, lse);
  };
  const auto [O, lse] = run(Q, K, V);
  Vec dQ(Q.size()), dK(K.size()), dV(V.size());
  cpu::attention_backward(dQ.data(), dK.data(), dV.data(), R.data(), Q.data(), K.data(), V.data(),
                          O.data(), lse.data(), B, S, nh, dqk, dv, scale, ws.data(), threads);
  expect_gradient([&](const Vec& q) { return dot(run(q, K, V).first, R); }, Q, dQ, "attention dQ");
  expect_gradient([&](const Vec& k) { return dot(run(Q, k, V).first, R); }, K, dK, "attention dK");
  expect_gradient([&](const Vec& v) { return dot(run(Q, K, v).first, R); }, V, dV, "attention dV");
  }
}

TEST(KernelGradients, SwiGlu) {
  const int64_t N = 4, I = 9;
  const Vec GU = randn(N * 2 * I, 18), R = randn(N * I, 19);
  const auto loss = [&](const Vec& gu) {
    Vec M(N * I);
    cpu::swiglu_forward(M.data(), gu.data(), N, I);
    return dot(M, R);
  };
  Vec dGU(GU.size());
  cpu::swiglu_backward(dGU.data(), R.data(), GU.data(), N, I);
  expect_gradient(loss, GU, dGU, "swiglu");
}

RouterParams v3_params(int64_t E, int64_t k, int64_t G, int64_t g) {
  RouterParams p;
  p.num_experts = E, p.top_k = k, p.n_group = G, p.topk_group = g;
  p.scoring = ScoringFunc::kSigmoid, p.method = TopkMethod::kNoauxTc;
  p.norm_topk_prob = true, p.routed_scaling_factor = 2.5f;
  return p;
}

// Brute-force reference of the selection rules of docs/model.md §3.6.
std::vector<int> naive_select(const Vec& s, const Vec& bias, const RouterParams& p) {
  const int64_t E = p.num_experts, per = E / p.n_group;
  Vec c(E);
  for (int64_t e = 0; e < E; ++e) c[e] = s[e] + (p.method == TopkMethod::kNoauxTc ? bias[e] : 0.0);
  std::vector<int> groups(p.n_group);
  std::iota(groups.begin(), groups.end(), 0);
  const auto gscore = [&](int g) {
    Vec v(c.begin() + g * per, c.begin() + (g + 1) * per);
    std::sort(v.rbegin(), v.rend());
    return p.method == TopkMethod::kNoauxTc ? v[0] + v[1] : v[0];
  };
  std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) { return gscore(a) > gscore(b); });
  std::vector<int> experts;
  for (int64_t e = 0; e < E; ++e) {
    const bool kept = p.method == TopkMethod::kGreedy ||
                      std::find(groups.begin(), groups.begin() + p.topk_group, e / per) !=
                          groups.begin() + p.topk_group;
    if (kept) experts.push_back(int(e));
  }
  std::stable_sort(experts.begin(), experts.end(), [&](int a, int b) { return c[a] > c[b]; });
  experts.resize(p.top_k);
  return experts;
}

TEST_P(Kernels, RouterSelectionAndWeights) {
  const int64_t N = 40;
  struct Case { RouterParams p; bool bias; };
  RouterParams greedy = v3_params(6, 2, 1, 1);
  greedy.scoring = ScoringFunc::kSoftmax, greedy.method = TopkMethod::kGreedy;
  greedy.norm_topk_prob = false, greedy.routed_scaling_factor = 1.0f, greedy.v2_weights = true;
  RouterParams limited = v3_params(8, 3, 4, 2);
  limited.scoring = ScoringFunc::kSoftmax, limited.method = TopkMethod::kGroupLimitedGreedy;
  limited.norm_topk_prob = false, limited.routed_scaling_factor = 16.0f, limited.v2_weights = true;
  const Case cases[] = {{v3_params(8, 2, 4, 2), true}, {v3_params(8, 3, 2, 1), true},
                        {v3_params(4, 2, 2, 2), false}, {greedy, false}, {limited, false}};
  for (const Case& cs : cases) {
    const RouterParams& p = cs.p;
    const int64_t E = p.num_experts, k = p.top_k;
    const Vec logits = randn(N * E, 20), bias = randn(E, 21, cs.bias ? 0.3 : 0.0);
    std::vector<int32_t> idx(N * k);
    FVec w(N * k), scores(N * E);
    be->router_forward({idx.data(), {N, p.top_k}}, {w.data(), {N, p.top_k}}, {scores.data(), {N, p.num_experts}},
                       {to_f(logits).data(), {N, p.num_experts}},
                       {cs.bias ? to_f(bias).data() : nullptr, {p.num_experts}}, p);
    for (int64_t t = 0; t < N; ++t) {
      Vec s(E);
      for (int64_t e = 0; e < E; ++e) s[e] = scores[t * E + e];
      const auto want = naive_select(s, bias, p);
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(idx[t * k + j], want[j]) << "token " << t;
        sum += s[want[j]];
      }
      for (int64_t j = 0; j < k; ++j) {
        const double raw = s[want[j]];
        const double expect = p.v2_weights ? raw * p.routed_scaling_factor
                                           : raw / (sum + 1e-20) * p.routed_scaling_factor;
        EXPECT_NEAR(w[t * k + j], expect, 1e-5);
      }
    }
  }
}

TEST(KernelGradients, RouterWeightsAndExtraScoreGradient) {
  const int64_t N = 5;
  RouterParams softmax_norm = v3_params(6, 3, 1, 1);
  softmax_norm.scoring = ScoringFunc::kSoftmax, softmax_norm.method = TopkMethod::kGreedy;
  softmax_norm.v2_weights = true;  // V2 remote-code rule: normalise, no scaling
  for (const RouterParams& p : {v3_params(8, 2, 4, 2), softmax_norm}) {
    const int64_t E = p.num_experts, k = p.top_k;
    const Vec logits = randn(N * E, 22), Rw = randn(N * k, 23), Rs = randn(N * E, 24);
    std::vector<int32_t> idx(N * k);
    Vec w(N * k), s(N * E);
    cpu::router_forward(idx.data(), w.data(), s.data(), logits.data(), (const double*)nullptr, N, p);
    // The selection is a constant of the backward: keep it fixed in the loss.
    const auto loss = [&](const Vec& l) {
      Vec ss(N * E), ww(N * k);
      std::vector<int32_t> id2(N * k);
      cpu::router_forward(id2.data(), ww.data(), ss.data(), l.data(), (const double*)nullptr, N, p);
      EXPECT_EQ(id2, idx);
      return dot(ww, Rw) + dot(ss, Rs);
    };
    Vec dl(N * E);
    cpu::router_backward(dl.data(), Rw.data(), Rs.data(), s.data(), idx.data(), N, p);
    expect_gradient(loss, logits, dl, "router");
  }
}

TEST(KernelGradients, MoeCombineAndDispatch) {
  const int64_t N = 4, k = 2, H = 5, rows = N * k;
  const Vec Y = randn(rows * H, 25), w = randn(N * k, 26), R = randn(N * H, 27), X = randn(N * H, 28);
  const std::vector<int32_t> pos = {3, 0, 5, 1, 7, 2, 4, 6};
  const auto combine = [&](const Vec& y, const Vec& ww) {
    Vec out(N * H, 0.0);
    cpu::moe_combine(out.data(), y.data(), ww.data(), pos.data(), N, k, H);
    return dot(out, R);
  };
  Vec dY(rows * H), dw(N * k);
  cpu::moe_combine_backward(dY.data(), dw.data(), R.data(), Y.data(), w.data(), pos.data(), N, k, H);
  expect_gradient([&](const Vec& y) { return combine(y, w); }, Y, dY, "combine dY");
  expect_gradient([&](const Vec& ww) { return combine(Y, ww); }, w, dw, "combine dw");
  // Dispatch: Xp[pos[t,j]] = X[t]; its backward sums the rows back.
  std::vector<int32_t> src(rows);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) src[pos[t * k + j]] = int32_t(t);
  const Vec Rp = randn(rows * H, 29);
  const auto dispatch = [&](const Vec& x) {
    Vec xp(rows * H);
    cpu::gather_rows(xp.data(), x.data(), src.data(), rows, H);
    return dot(xp, Rp);
  };
  Vec dX(N * H, 0.0);
  cpu::moe_dispatch_backward(dX.data(), Rp.data(), pos.data(), N, k, H);
  expect_gradient(dispatch, X, dX, "dispatch");
}

// The dispatch plan against a stable sort of the slots by expert, with experts left empty.
TEST(MoePlan, SortsRowsByExpertThenTokenThenSlot) {
  auto be = make_cpu_backend(1);
  const int64_t N = 37, k = 3, E = 11;
  std::mt19937 rng(5);
  std::vector<int32_t> idx(size_t(N * k));
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) idx[size_t(t * k + j)] = int32_t(rng() % (E - 2));  // experts 9, 10 empty
  std::vector<int32_t> pos(idx.size(), -1), src(idx.size(), -1), counts(size_t(E), -1);
  be->moe_plan({pos.data(), {N, k}}, {src.data(), {N * k}}, {counts.data(), {E}}, {idx.data(), {N, k}});
  std::vector<int32_t> order(idx.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return idx[size_t(a)] < idx[size_t(b)]; });
  for (size_t row = 0; row < order.size(); ++row) {
    EXPECT_EQ(src[row], order[row] / k) << "row " << row;
    EXPECT_EQ(pos[size_t(order[row])], int32_t(row)) << "slot " << order[row];
  }
  for (int64_t e = 0; e < E; ++e)
    EXPECT_EQ(counts[size_t(e)], std::count(idx.begin(), idx.end(), int32_t(e))) << "expert " << e;
  EXPECT_EQ(counts[9], 0);
  idx[7] = int32_t(E);  // out of range: refused, by name
  try {
    be->moe_plan({pos.data(), {N, k}}, {src.data(), {N * k}}, {counts.data(), {E}}, {idx.data(), {N, k}});
    ADD_FAILURE() << "an expert id of " << E << " was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expert 11 of 11"), std::string::npos) << e.what();
  }
}

// The balance loss (docs/model.md §5.2) on the backend — per sequence, over a token part that
// starts mid-sequence (a tensor-parallel rank's), and over the whole batch — against its
// definition: aux = weight sum_g sum_e f_ge P_ge with f from the (constant) selection, and
// dscores against central finite differences of that in double.
TEST(KernelGradients, BalanceLossStatisticsLossAndScoreGradient) {
  auto be = make_cpu_backend(1);
  const int64_t S = 6, B = 3, E = 5, k = 2;
  struct Case {
    int64_t first, n, group_len, groups, T;
  };
  for (const Case c : {Case{0, B * S, S, B, S}, Case{4, 9, S, B, S}, Case{0, B * S, 0, 1, B * S}}) {
    const int64_t n = c.n;
    Vec s0 = randn(size_t(n * E), 60);
    for (double& x : s0) x = 1.0 / (1.0 + std::exp(-x));  // sigmoid scores, positive
    std::mt19937 rng(61);
    std::vector<int32_t> idx(size_t(n * k));
    for (int64_t i = 0; i < n; ++i) {
      idx[size_t(i * k)] = int32_t(rng() % E);
      idx[size_t(i * k + 1)] = int32_t((idx[size_t(i * k)] + 1 + rng() % (E - 1)) % E);
    }
    const auto group = [&](int64_t i) { return c.group_len > 0 ? (c.first + i) / c.group_len : 0; };
    const double weight = 0.37, grad_scale = 8.0;
    const auto stats_of = [&](const Vec& s) {
      Vec st(size_t(2 * c.groups * E), 0.0);
      for (int64_t i = 0; i < n; ++i) {
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += s[size_t(i * E + e)];
        for (int64_t j = 0; j < k; ++j) st[size_t(group(i) * E + idx[size_t(i * k + j)])] += double(E) / (k * c.T);
        for (int64_t e = 0; e < E; ++e) st[size_t(c.groups * E + group(i) * E + e)] += s[size_t(i * E + e)] / sum / c.T;
      }
      return st;
    };
    const auto aux_of = [&](const Vec& s) {
      const Vec st = stats_of(s);
      double a = 0;
      for (int64_t g = 0; g < c.groups; ++g)
        for (int64_t e = 0; e < E; ++e) a += weight * st[size_t(g * E + e)] * st[size_t(c.groups * E + g * E + e)];
      return a;
    };
    Backend::BalanceShape shape;
    shape.n = n, shape.k = k, shape.E = E, shape.first = c.first, shape.group_len = c.group_len;
    shape.groups = c.groups, shape.T = c.T;
    const FVec sf = to_f(s0);
    FVec stats(size_t(2 * c.groups * E)), dscores(size_t(n * E));
    be->moe_balance_stats({stats.data(), {2, shape.groups, shape.E}}, {idx.data(), {shape.n, shape.k}},
                          {sf.data(), {shape.n, shape.E}}, shape);
    EXPECT_LT(max_rel_err(stats, stats_of(Vec(sf.begin(), sf.end()))), 1e-6) << "first " << c.first;
    float aux = 0.25f;  // accumulated into
    be->moe_balance_grad({dscores.data(), {shape.n, shape.E}}, {&aux, {1}}, {stats.data(), {2, shape.groups, shape.E}},
                         {sf.data(), {shape.n, shape.E}}, shape, weight, grad_scale);
    const double want = aux_of(Vec(sf.begin(), sf.end()));
    EXPECT_NEAR(aux, 0.25 + want, 1e-6 * want + 1e-7) << "first " << c.first;
    Vec fd(size_t(n * E));
    const Vec sd(sf.begin(), sf.end());
    for (size_t i = 0; i < fd.size(); ++i) {
      Vec p = sd, m = sd;
      const double h = 1e-5;
      p[i] += h, m[i] -= h;
      fd[i] = grad_scale * (aux_of(p) - aux_of(m)) / (2 * h);
    }
    EXPECT_LT(max_rel_err(dscores, fd), 1e-4) << "first " << c.first;
    FVec again(dscores.size());
    be->moe_balance_grad({again.data(), {shape.n, shape.E}}, {}, {stats.data(), {2, shape.groups, shape.E}},
                         {sf.data(), {shape.n, shape.E}}, shape, weight, grad_scale);  // no aux
    EXPECT_EQ(again, dscores);
  }
}

TEST_P(Kernels, SwiGluForward) {
  const int64_t N = 3, I = 21;
  const Vec GU = randn(N * 2 * I, 40);
  FVec M(N * I);
  be->swiglu_forward({M.data(), {N, I}}, {to_f(GU).data(), {N, 2 * I}});
  Vec want(N * I);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t i = 0; i < I; ++i) {
      const double g = GU[t * 2 * I + i], u = GU[t * 2 * I + I + i];
      want[t * I + i] = g / (1.0 + std::exp(-g)) * u;
    }
  EXPECT_LT(max_rel_err(M, want), 1e-6);
}

// The typed-output forms, the producers of 16-bit GEMM inputs (docs/design.md §6.10): into fp32
// they are the fp32 ops; into bf16 / fp16 they write what the fp32 op followed by convert()
// writes, bit for bit — odd widths (every vector tail), large values (fp16 overflow to inf),
// values near the rounding ties.
TEST_P(Kernels, RmsNormSwiGluAndGatherIntoSixteenBitsEqualTheFp32OpThenConvert) {
  const int64_t N = 37, I = 1029, H = 515, rows = 2 * N;
  FVec GU = to_f(randn(size_t(N * 2 * I), 45, 4.0)), X = to_f(randn(size_t(N * H), 46, 3.0));
  GU[5] = 300.0f, GU[I + 5] = 400.0f, X[7] = 1e5f, X[8] = -7e4f;  // past fp16's range
  for (int64_t i = 0; i < 64; ++i) X[size_t(100 + i)] = 1.0f + float(i) * 0x1.0p-8f + 0x1.0p-9f;  // bf16 ties
  std::vector<int32_t> src(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) src[size_t(r)] = int32_t((r * 7 + 3) % N);
  FVec M(size_t(N * I)), Xp(size_t(rows * H)), M32(M.size()), Xp32(Xp.size());
  be->swiglu_forward({M.data(), {N, I}}, {GU.data(), {N, 2 * I}});
  be->gather_rows({Xp.data(), {rows, H}}, {X.data(), {N, H}}, {src.data(), {rows}});
  be->swiglu_forward({View{M32.data(), DType::kF32}, {N, I}}, {GU.data(), {N, 2 * I}});
  be->gather_rows({View{Xp32.data(), DType::kF32}, {rows, H}}, {X.data(), {N, H}}, {src.data(), {rows}});
  EXPECT_EQ(M32, M);
  EXPECT_EQ(Xp32, Xp);
  const FVec w = to_f(randn(size_t(H), 47, 2.0));
  FVec Y(size_t(N * H)), rstd(static_cast<size_t>(N)), Y32(Y.size()), rstd32(rstd.size()), rstd16(rstd.size());
  be->rmsnorm_forward({Y.data(), {N, H}}, {rstd.data(), {N}}, {X.data(), {N, H}}, {w.data(), {H}}, 1e-6f);
  be->rmsnorm_forward({View{Y32.data(), DType::kF32}, {N, H}}, {rstd32.data(), {N}}, {X.data(), {N, H}},
                      {w.data(), {H}}, 1e-6f);
  EXPECT_EQ(Y32, Y);
  EXPECT_EQ(rstd32, rstd);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> want(M.size()), got(M.size()), wantx(Xp.size()), gotx(Xp.size());
    be->convert({View{want.data(), dt}, {N * I}}, {f32(M.data()), {N * I}});
    be->swiglu_forward({View{got.data(), dt}, {N, I}}, {GU.data(), {N, 2 * I}});
    EXPECT_EQ(got, want) << to_string(dt);
    be->convert({View{wantx.data(), dt}, {rows * H}}, {f32(Xp.data()), {rows * H}});
    be->gather_rows({View{gotx.data(), dt}, {rows, H}}, {X.data(), {N, H}}, {src.data(), {rows}});
    EXPECT_EQ(gotx, wantx) << to_string(dt);
    std::vector<uint16_t> wanty(Y.size()), goty(Y.size());
    be->convert({View{wanty.data(), dt}, {N * H}}, {f32(Y.data()), {N * H}});
    be->rmsnorm_forward({View{goty.data(), dt}, {N, H}}, {rstd16.data(), {N}}, {X.data(), {N, H}}, {w.data(), {H}},
                        1e-6f);
    EXPECT_EQ(goty, wanty) << to_string(dt);
    EXPECT_EQ(rstd16, rstd) << to_string(dt);
  }
  // SwiGLU's backward into 16 bits (the experts' dGU): the fp32 op's values, rounded.
  const FVec dM = to_f(randn(size_t(N * I), 48, 5.0));
  FVec dGU(GU.size()), dGU32(GU.size());
  be->swiglu_backward({dGU.data(), {N, 2 * I}}, {dM.data(), {N, I}}, {GU.data(), {N, 2 * I}});
  be->swiglu_backward({View{dGU32.data(), DType::kF32}, {N, 2 * I}}, {dM.data(), {N, I}}, {GU.data(), {N, 2 * I}});
  EXPECT_EQ(dGU32, dGU);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> want(dGU.size()), got(dGU.size(), 0xffff);
    be->convert({View{want.data(), dt}, {N * 2 * I}}, {f32(dGU.data()), {N * 2 * I}});
    be->swiglu_backward({View{got.data(), dt}, {N, 2 * I}}, {dM.data(), {N, I}}, {GU.data(), {N, 2 * I}});
    EXPECT_EQ(got, want) << "swiglu backward into " << to_string(dt);
  }
  // The combine's backward into 16 bits (the experts' dY), dw unchanged. pos: a permutation of
  // the rows[N, 2] (choice j of token t at row pos[t, j]).
  const int64_t k = 2;
  std::vector<int32_t> pos(size_t(N * k));
  for (int64_t r = 0; r < N * k; ++r) pos[size_t(r)] = int32_t((r * 29 + 5) % (N * k));
  const FVec dout = to_f(randn(size_t(N * H), 49, 2.0)), Yc = to_f(randn(size_t(N * k * H), 50)),
             wk = to_f(randn(size_t(N * k), 51));
  FVec dY(size_t(N * k * H)), dw(size_t(N * k)), dY32(dY.size()), dw32(dw.size()), dw16(dw.size());
  be->moe_combine_backward({dY.data(), {N * k, H}}, {dw.data(), {N, k}}, {dout.data(), {N, H}}, {Yc.data(), {N * k, H}},
                           {wk.data(), {N, k}}, {pos.data(), {N, k}});
  be->moe_combine_backward({View{dY32.data(), DType::kF32}, {N * k, H}}, {dw32.data(), {N, k}}, {dout.data(), {N, H}},
                           {Yc.data(), {N * k, H}}, {wk.data(), {N, k}}, {pos.data(), {N, k}});
  EXPECT_EQ(dY32, dY);
  EXPECT_EQ(dw32, dw);
  for (DType dt : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> want(dY.size()), got(dY.size(), 0xffff);
    be->convert({View{want.data(), dt}, {N * k * H}}, {f32(dY.data()), {N * k * H}});
    be->moe_combine_backward({View{got.data(), dt}, {N * k, H}}, {dw16.data(), {N, k}}, {dout.data(), {N, H}},
                             {Yc.data(), {N * k, H}}, {wk.data(), {N, k}}, {pos.data(), {N, k}});
    EXPECT_EQ(got, want) << "moe combine backward into " << to_string(dt);
    EXPECT_EQ(dw16, dw) << to_string(dt);
  }
}

// The strided copy and RoPE into a typed output (MLA's Q, K, V and its dkv / dq as their
// GEMMs read them, docs/design.md §6.10), laid out as MLA lays them out — per (token, head) a
// nope part by copy_strided and a rope part by RoPE, with a gap left unwritten: into fp32 the
// fp32 ops; into bf16 / fp16 bit for bit the fp32 result converted, the gap untouched. Into 16
// bits RoPE's backward refuses to accumulate and leaves din as it was.
TEST_P(Kernels, CopyStridedAndRopeIntoSixteenBitsEqualTheFp32OpThenConvert) {
  const int64_t N = 29, S = 11, heads = 3, dn = 37, dr = 18, gap = 5, hs = dn + dr + gap, ts = heads * hs;
  const int64_t in_hs = dn + dr + 3, in_ts = heads * in_hs;  // the source's own strides
  const auto [c, s] = rope_tables(S, dr, 10000.0);
  const FVec cf = to_f(c), sf = to_f(s);
  FVec src = to_f(randn(size_t(N * in_ts), 52, 3.0));
  src[3] = 1e5f, src[4] = -7e4f, src[size_t(in_ts + dn + 1)] = 9e4f;  // past fp16's range, nope and rope parts
  for (int64_t i = 0; i < 40; ++i) src[size_t(2 * in_ts + i)] = 1.0f + float(i) * 0x1.0p-8f + 0x1.0p-9f;  // ties
  const FVec base = to_f(randn(size_t(N * ts), 53));  // what the unwritten gap holds
  for (bool il : {false, true}) {
    const std::string tag = il ? " interleaved" : "";
    // forward: dst[t, h] = [src nope | rope(src rope part)]; backward: [src nope | rope^-1(src)]
    const auto run = [&](View dst, bool backward) {
      be->copy_strided({dst, {N * heads, dn}, {hs, 1}},
                       {src.data(), {N * heads, dn}, {in_hs, 1}});  // one row per (token, head)
      const View r = offset_view(dst, dn);
      if (backward)
        be->rope_backward({r, {N, heads, dr}, {ts, hs, 1}}, {src.data() + dn, {N, heads, dr}, {in_ts, in_hs, 1}},
                          {cf.data(), {S, dr / 2}}, {sf.data(), {S, dr / 2}}, il, false);
      else
        be->rope_forward({r, {N, heads, dr}, {ts, hs, 1}}, {src.data() + dn, {N, heads, dr}, {in_ts, in_hs, 1}},
                         {cf.data(), {S, dr / 2}}, {sf.data(), {S, dr / 2}}, il);
    };
    for (bool backward : {false, true}) {
      const std::string what = std::string(backward ? "rope backward" : "rope forward") + tag;
      // The fp32 reference from the float* ops, row by row of (token, head) for the copy.
      FVec want = base;
      for (int64_t t = 0; t < N; ++t)
        be->copy_strided({want.data() + t * ts, {heads, dn}, {hs, 1}},
                         {src.data() + t * in_ts, {heads, dn}, {in_hs, 1}});
      if (backward)
        be->rope_backward({want.data() + dn, {N, heads, dr}, {ts, hs, 1}},
                          {src.data() + dn, {N, heads, dr}, {in_ts, in_hs, 1}}, {cf.data(), {S, dr / 2}},
                          {sf.data(), {S, dr / 2}}, il, false);
      else
        be->rope_forward({want.data() + dn, {N, heads, dr}, {ts, hs, 1}},
                         {src.data() + dn, {N, heads, dr}, {in_ts, in_hs, 1}}, {cf.data(), {S, dr / 2}},
                         {sf.data(), {S, dr / 2}}, il);
      for (int64_t t = 0; t < N; ++t)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t j = 0; j < dn; ++j)
            ASSERT_EQ(want[size_t(t * ts + h * hs + j)], src[size_t(t * in_ts + h * in_hs + j)]) << what;
      FVec got = base;
      run(View{got.data(), DType::kF32}, backward);
      EXPECT_EQ(got, want) << what << " into fp32";
      for (DType dt : {DType::kBF16, DType::kF16}) {
        std::vector<uint16_t> want16(want.size()), got16(want.size());
        be->convert({View{want16.data(), dt}, {N * ts}}, {f32(want.data()), {N * ts}});
        be->convert({View{got16.data(), dt}, {N * ts}}, {f32(base.data()), {N * ts}});
        run(View{got16.data(), dt}, backward);
        EXPECT_EQ(got16, want16) << what << " into " << to_string(dt);
      }
    }
    std::vector<uint16_t> untouched(size_t(N * ts), 0x1234);
    EXPECT_THROW(be->rope_backward({View{untouched.data(), DType::kBF16}, {N, heads, dr}, {ts, hs, 1}},
                                   {src.data() + dn, {N, heads, dr}, {in_ts, in_hs, 1}}, {cf.data(), {S, dr / 2}},
                                   {sf.data(), {S, dr / 2}}, il, true),
                 std::invalid_argument);
    EXPECT_EQ(untouched, std::vector<uint16_t>(size_t(N * ts), 0x1234));
  }
}

TEST_P(Kernels, MoeGatherAndCombineForward) {
  const int64_t N = 5, k = 2, H = 7;
  const Vec X = randn(N * H, 41), Y = randn(N * k * H, 42), w = randn(N * k, 43), base = randn(N * H, 44);
  const std::vector<int32_t> src = {4, 0, 2, 2, 1, 3, 0, 4, 1, 3};  // row -> token
  std::vector<int32_t> pos(N * k);
  std::vector<int> used(N, 0);
  for (int32_t row = 0; row < N * k; ++row) pos[src[row] * k + used[src[row]]++] = row;
  FVec Xp(N * k * H), out = to_f(base);
  be->gather_rows({Xp.data(), {N * k, H}}, {to_f(X).data(), {N, H}}, {src.data(), {N * k}});
  be->moe_combine({out.data(), {N, H}}, {to_f(Y).data(), {N * k, H}}, {to_f(w).data(), {N, k}}, {pos.data(), {N, k}});
  for (int64_t r = 0; r < N * k; ++r)
    for (int64_t c = 0; c < H; ++c) EXPECT_EQ(Xp[r * H + c], float(X[src[r] * H + c]));
  Vec want = base;
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < H; ++c) want[t * H + c] += w[t * k + j] * Y[pos[t * k + j] * H + c];
  EXPECT_LT(max_rel_err(out, want), 1e-6);
}

TEST_P(Kernels, CrossEntropyValueGradientAndIgnoredRows) {
  const int64_t rows = 4, V = 11;
  const Vec logits = randn(rows * V, 30, 3.0);
  const std::vector<int32_t> target = {3, -100, 10, 0};
  FVec l = to_f(logits), loss(rows);
  be->cross_entropy({loss.data(), {rows}}, {l.data(), {rows, V}}, {target.data(), {rows}}, 0.5f);
  for (int64_t r = 0; r < rows; ++r) {
    if (target[r] < 0) {
      EXPECT_EQ(loss[r], 0.0f);
      for (int64_t v = 0; v < V; ++v) EXPECT_EQ(l[r * V + v], 0.0f);
      continue;
    }
    double mx = -1e300, sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, logits[r * V + v]);
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[r * V + v] - mx);
    const double lse = mx + std::log(sum);
    EXPECT_NEAR(loss[r], lse - logits[r * V + target[r]], 1e-5);
    for (int64_t v = 0; v < V; ++v)
      EXPECT_NEAR(l[r * V + v], 0.5 * (std::exp(logits[r * V + v] - lse) - (v == target[r])), 1e-6);
  }
}

TEST_P(Kernels, EmbeddingRepeatedIdsAccumulate) {
  const int64_t V = 5, H = 70, N = 6;
  const std::vector<int32_t> ids = {2, 4, 2, 0, 2, 4};
  const FVec table = to_f(randn(V * H, 31)), dout = to_f(randn(N * H, 32));
  FVec out(N * H), dtable(V * H, 0.0f);
  be->embedding_forward({out.data(), {N, H}}, {kernels::f32(table.data()), {V, H}}, {ids.data(), {N}});
  be->embedding_backward({dtable.data(), {V, H}}, {dout.data(), {N, H}}, {ids.data(), {N}});
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < H; ++c) EXPECT_EQ(out[t * H + c], table[ids[t] * H + c]);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t c = 0; c < H; ++c) {
      double want = 0;
      for (int64_t t = 0; t < N; ++t) want += ids[t] == v ? dout[t * H + c] : 0.0;
      EXPECT_NEAR(dtable[v * H + c], want, 1e-6);
    }
}

// Under mixed precision the lookup reads the table's 16-bit compute copy (there is no fp32 copy
// of it): each row widened exactly — the fp32 lookup of the widened table, bit for bit — and a
// negative id (another shard's row) a zero row.
TEST_P(Kernels, EmbeddingReadsA16BitTable) {
  const int64_t V = 7, H = 4100, N = 9;  // H past a vector block, not a multiple of one
  const std::vector<int32_t> ids = {6, -1, 2, 6, 0, 3, -5, 1, 2};
  const FVec table = to_f(randn(V * H, 41));
  for (const DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> lp(size_t(V * H));
    FVec wide(size_t(V * H)), want(size_t(N * H), -1.0f), got(size_t(N * H), -1.0f);
    be->convert({lp.data(), t, {V * H}}, {f32(table.data()), {V * H}});
    be->convert({wide.data(), DType::kF32, {V * H}}, {ConstView{lp.data(), t}, {V * H}});
    be->embedding_forward({want.data(), {N, H}}, {f32(wide.data()), {V, H}}, {ids.data(), {N}});
    be->embedding_forward({got.data(), {N, H}}, {ConstView{lp.data(), t}, {V, H}}, {ids.data(), {N}});
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * 4), 0) << to_string(t);
    EXPECT_EQ(got[1 * H + 5], 0.0f);
    EXPECT_EQ(got[2 * H + 17], wide[2 * H + 17]);
    EXPECT_NE(got[2 * H + 17], 0.0f);
  }
}

// The vocabulary-parallel cross-entropy over uneven column shards (the last one shorter, one
// empty), with the cross-rank reductions done by hand, against the one-shard kernel.
TEST_P(Kernels, VocabParallelCrossEntropyEqualsWholeRow) {
  const int64_t rows = 5, V = 11;
  const Vec logits = randn(rows * V, 33, 4.0);
  const std::vector<int32_t> target = {3, -100, 10, 0, 7};
  FVec whole = to_f(logits), want_loss(rows);
  be->cross_entropy({want_loss.data(), {rows}}, {whole.data(), {rows, V}}, {target.data(), {rows}}, 0.25f);
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 4, 8, 11},
                                             std::vector<int64_t>{0, 6, 11, 11}}) {
    const size_t shards = bounds.size() - 1;
    std::vector<FVec> part(shards);
    FVec mx(rows, -std::numeric_limits<float>::infinity()), sums(2 * rows, 0.0f), loss(rows);
    for (size_t s = 0; s < shards; ++s) {
      const int64_t v0 = bounds[s], Vl = bounds[s + 1] - v0;
      part[s].resize(rows * Vl);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t v = 0; v < Vl; ++v) part[s][r * Vl + v] = float(logits[r * V + v0 + v]);
      FVec m(rows);
      be->cross_entropy_row_max({m.data(), {rows}}, {part[s].data(), {rows, Vl}});
      for (int64_t r = 0; r < rows; ++r) mx[r] = std::max(mx[r], m[r]);
    }
    for (size_t s = 0; s < shards; ++s) {
      const int64_t v0 = bounds[s], Vl = bounds[s + 1] - v0;
      FVec su(2 * rows);
      be->cross_entropy_row_sums({su.data(), {rows, 2}}, {part[s].data(), {rows, Vl}}, {mx.data(), {rows}},
                                 {target.data(), {rows}}, v0);
      for (int64_t i = 0; i < 2 * rows; ++i) sums[i] += su[i];
    }
    for (size_t s = 0; s < shards; ++s) {
      const int64_t v0 = bounds[s], Vl = bounds[s + 1] - v0;
      be->cross_entropy_finish({loss.data(), {rows}}, {part[s].data(), {rows, Vl}}, {mx.data(), {rows}},
                               {sums.data(), {rows, 2}}, {target.data(), {rows}}, v0, 0.25f);
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_NEAR(loss[r], want_loss[r], 1e-5) << "row " << r;
        for (int64_t v = 0; v < Vl; ++v)
          EXPECT_NEAR(part[s][r * Vl + v], whole[r * V + v0 + v], 1e-7) << "row " << r << " column " << v0 + v;
      }
    }
  }
}

TEST_P(Kernels, EmbeddingSkipsIdsOfOtherShards) {
  const int64_t V = 3, H = 20, N = 4;
  const std::vector<int32_t> ids = {1, -1, 2, -1};
  const FVec table = to_f(randn(V * H, 34)), dout = to_f(randn(N * H, 35));
  FVec out(N * H, 7.0f), dtable(V * H, 0.0f);
  be->embedding_forward({out.data(), {N, H}}, {kernels::f32(table.data()), {V, H}}, {ids.data(), {N}});
  be->embedding_backward({dtable.data(), {V, H}}, {dout.data(), {N, H}}, {ids.data(), {N}});
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < H; ++c) EXPECT_EQ(out[t * H + c], ids[t] < 0 ? 0.0f : table[ids[t] * H + c]);
  for (int64_t c = 0; c < H; ++c) {
    EXPECT_EQ(dtable[c], 0.0f);
    EXPECT_EQ(dtable[1 * H + c], dout[c]);
    EXPECT_EQ(dtable[2 * H + c], dout[2 * H + c]);
  }
}

// One AdamW step computed by hand (PyTorch semantics: decoupled decay, bias correction).
TEST_P(Kernels, AdamWMatchesAHandComputedStep) {
  FVec p = {1.0f, -2.0f}, g = {0.5f, 0.25f}, m = {0.1f, 0.0f}, v = {0.01f, 0.0f};
  AdamWParams a;
  a.lr = 0.1f, a.beta1 = 0.9f, a.beta2 = 0.99f, a.eps = 1e-8f, a.weight_decay = 0.01f, a.step = 3;
  be->adamw({p.data(), {2}}, {g.data(), {2}}, {m.data(), {2}}, {v.data(), {2}}, a);
  const double m0 = 0.9 * 0.1 + 0.1 * 0.5, v0 = 0.99 * 0.01 + 0.01 * 0.25;
  const double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.99, 3);
  const double p0 = 1.0 * (1 - 0.1 * 0.01) - 0.1 * (m0 / bc1) / (std::sqrt(v0 / bc2) + 1e-8);
  EXPECT_NEAR(m[0], m0, 1e-7);
  EXPECT_NEAR(v[0], v0, 1e-7);
  EXPECT_NEAR(p[0], p0, 1e-6);
  const double m1 = 0.1 * 0.25, v1 = 0.01 * 0.0625;
  const double p1 = -2.0 * (1 - 0.001) - 0.1 * (m1 / bc1) / (std::sqrt(v1 / bc2) + 1e-8);
  EXPECT_NEAR(p[1], p1, 1e-6);
}

// grad_scale (fused clipping) equals scaling the gradient beforehand.
TEST_P(Kernels, AdamWGradScaleEqualsScaledGradient) {
  FVec p1 = {1.0f, -2.0f, 0.5f}, g = {0.5f, -0.25f, 3.0f}, m1 = {0.1f, 0.0f, -0.2f}, v1 = {0.01f, 0.0f, 0.3f};
  FVec p2 = p1, m2 = m1, v2 = v1, g2 = g;
  AdamWParams a;
  a.lr = 0.05f, a.weight_decay = 0.1f, a.step = 2;
  for (float& x : g2) x *= 0.375f;
  be->adamw({p2.data(), {3}}, {g2.data(), {3}}, {m2.data(), {3}}, {v2.data(), {3}}, a);
  a.grad_scale = 0.375f;
  be->adamw({p1.data(), {3}}, {g.data(), {3}}, {m1.data(), {3}}, {v1.data(), {3}}, a);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FLOAT_EQ(p1[i], p2[i]);
    EXPECT_FLOAT_EQ(m1[i], m2[i]);
    EXPECT_FLOAT_EQ(v1[i], v2[i]);
  }
}

// Mixed precision's fused step (adamw_round) gives the bits of adamw, convert and convert one
// after another, for both 16-bit types, over a length that is not a multiple of the CPU's
// blocks and values that round to a bf16 / fp16 subnormal, overflow fp16, or are exact.
TEST_P(Kernels, AdamWRoundEqualsAdamWThenConvert) {
  const int64_t n = 3 * 4096 + 77;
  FVec p0 = to_f(randn(n, 31)), g = to_f(randn(n, 32)), m0 = to_f(randn(n, 33, 0.1)), v0 = to_f(randn(n, 34, 0.1));
  for (float& x : v0) x = std::fabs(x);
  p0[0] = 1e-40f, p0[1] = 7e4f, p0[2] = -3e-6f, p0[3] = 1.0f, g[3] = 0.0f, m0[3] = v0[3] = 0.0f;
  for (const DType t : {DType::kBF16, DType::kF16}) {
    for (const bool widen : {true, false}) {
      FVec p1 = p0, m1 = m0, v1 = v0, p2 = p0, m2 = m0, v2 = v0, w1(n, -1.0f), w2(n, -1.0f);
      std::vector<uint16_t> h1(n, 0xffff), h2(n, 0xffff);
      AdamWParams a;
      a.lr = 0.02f, a.step = 5, a.weight_decay = 0.1f, a.grad_scale = 0.75f;
      be->adamw({p1.data(), {n}}, {g.data(), {n}}, {m1.data(), {n}}, {v1.data(), {n}}, a);
      be->convert({h1.data(), t, {n}}, {f32(p1.data()), {n}});
      if (widen) be->convert({w1.data(), DType::kF32, {n}}, {ConstView{h1.data(), t}, {n}});
      be->adamw_round({p2.data(), {n}}, {g.data(), {n}}, {m2.data(), {n}}, {v2.data(), {n}}, a, {h2.data(), t, {n}},
                      {widen ? w2.data() : nullptr, {n}});
      int64_t differ = 0;
      for (int64_t i = 0; i < n; ++i)
        differ += std::memcmp(&p1[i], &p2[i], 4) != 0 || std::memcmp(&m1[i], &m2[i], 4) != 0 ||
                  std::memcmp(&v1[i], &v2[i], 4) != 0 || h1[i] != h2[i] || std::memcmp(&w1[i], &w2[i], 4) != 0;
      EXPECT_EQ(differ, 0) << to_string(t) << (widen ? " widened" : "");
      EXPECT_NE(p2[7], p0[7]);  // it did step
      if (!widen) {
        EXPECT_EQ(w2[0], -1.0f);
      }
    }
  }
  FVec p(4), m(4), v(4), w(4);
  EXPECT_THROW(be->adamw_round({p.data(), {4}}, {g.data(), {4}}, {m.data(), {4}}, {v.data(), {4}}, AdamWParams{},
                               {w.data(), DType::kF32, {4}}, {}),
               std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Gemm, Kernels, ::testing::Values(GemmLibrary::kOpenBlas, GemmLibrary::kOneDnn),
                         [](const auto& info) { return std::string(info.param == GemmLibrary::kOneDnn ? "onednn" : "openblas"); });

}  // namespace
}  // namespace dstrain::kernels
