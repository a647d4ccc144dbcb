// model::Linear (docs/design.md §6.2): shapes and splits read from the parameter table, fused
// and sliced weights, and its GEMMs against a naive reference — fp32, and bf16 / fp16 on the
// rounded operands — with every form of input (fp32, pinned, 16-bit only) giving the same bits,
// and a deferred weight gradient equal to the immediate one.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "engine/model/linear.h"
#include "engine/plan/parallel_plan.h"
#include "tests/unit/test_helpers.h"

namespace dstrain::model {
namespace {

struct Fixture {
  explicit Fixture(int tp = 1, int tp_rank = 0)
      : plan(plan::make_plan(testing::load("train_batch_size: 16\nmodel:\n  preset: tiny\n",
                                           {"parallel.tensor=" + std::to_string(tp)}),
                             tp)),
        params(plan.params, plan.param_stage, plan.config.model.num_routed(), {0, tp_rank, tp, 0, 1}),
        be(kernels::make_cpu_backend(1)) {
    params.pad(params.dense_numel(), params.expert_numel());
  }
  // A LayerEnv computing in `dtype` (fp32: no cast).
  LayerEnv env(kernels::DType dtype) {
    if (dtype != kernels::DType::kF32) {
      params.enable_compute_copy(dtype);
      cast = std::make_unique<ComputeCast>(*be, dtype);
    }
    LayerEnv e;
    e.cfg = &plan.config.model, e.be = be.get(), e.params = &params, e.cast = cast.get();
    return e;
  }
  // The values a Linear's GEMMs multiply by, [out, in], as fp32.
  std::vector<float> weight_values(const Linear& l) {
    const int64_t n = l.out() * l.in();
    std::vector<float> w(static_cast<size_t>(n));
    if (l.weight().lp && cast)
      be->convert({kernels::View{w.data(), kernels::DType::kF32}, {n}}, {l.weight().lp, cast->dtype(), {n}});
    else
      std::copy(l.weight().w, l.weight().w + n, w.begin());
    return w;
  }
  std::vector<float> rounded(const std::vector<float>& x, kernels::DType t) {
    if (t == kernels::DType::kF32) return x;
    std::vector<uint16_t> h(x.size());
    std::vector<float> out(x.size());
    be->convert({h.data(), t, {int64_t(x.size())}}, {kernels::f32(x.data()), {int64_t(x.size())}});
    be->convert({kernels::View{out.data(), kernels::DType::kF32}, {int64_t(x.size())}},
                {h.data(), t, {int64_t(x.size())}});
    return out;
  }

  plan::ParallelPlan plan;
  ParamStore params;
  std::unique_ptr<kernels::Backend> be;
  std::unique_ptr<ComputeCast> cast;
};

std::vector<float> random_values(int64_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(gen);
  return v;
}

// C[m, n] = sum_k A[m, k] B(k, n), in double.
std::vector<double> naive(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n, int64_t k,
                          bool b_is_nk) {
  std::vector<double> c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t q = 0; q < k; ++q) s += double(a[size_t(i * k + q)]) * b[size_t(b_is_nk ? j * k + q : q * n + j)];
      c[size_t(i * n + j)] = s;
    }
  return c;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 1e-30, worst = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - want[i]));
  EXPECT_LT(worst / scale, tol) << what;
}

TEST(Linear, ShapesAndSplitsComeFromTheParameterTable) {
  Fixture f(2, 1);
  const config::ModelConfig& m = f.plan.config.model;
  const std::string a = "model.layers.0.self_attn.";
  const int64_t nh = m.num_attention_heads / 2, H = m.hidden_size;
  const Linear kv_b(f.params, a + "kv_b_proj.weight"), o(f.params, a + "o_proj.weight");
  EXPECT_EQ(kv_b.split(), plan::Shard::kColumn);
  EXPECT_EQ(kv_b.out(), nh * (m.qk_nope_head_dim + m.v_head_dim));
  EXPECT_EQ(kv_b.in(), m.kv_lora_rank);
  EXPECT_EQ(o.split(), plan::Shard::kRow);
  EXPECT_EQ(o.out(), H);
  EXPECT_EQ(o.in(), nh * m.v_head_dim);
  const Linear kv_a(f.params, a + "kv_a_proj_with_mqa.weight");
  EXPECT_EQ(kv_a.split(), plan::Shard::kReplicated);
  EXPECT_EQ(kv_a.out(), m.kv_lora_rank + m.qk_rope_head_dim);
  const Linear pe = kv_a.rows(m.kv_lora_rank, m.qk_rope_head_dim);
  EXPECT_EQ(pe.out(), m.qk_rope_head_dim);
  EXPECT_EQ(pe.weight().g, kv_a.weight().g + m.kv_lora_rank * H);
  EXPECT_EQ(pe.weight().w, kv_a.weight().w + m.kv_lora_rank * H);
  EXPECT_THROW(kv_a.rows(1, kv_a.out()), Error);
  // gate_proj and up_proj: one weight of twice the (local) width.
  const std::string mlp = "model.layers.0.mlp.";
  const Linear gu(f.params, mlp + "gate_proj.weight", {mlp + "up_proj.weight"});
  EXPECT_EQ(gu.out(), 2 * m.intermediate_size / 2);
  EXPECT_EQ(gu.split(), plan::Shard::kColumn);
  // Not stored back to back, or another input width: refused, naming both.
  try {
    Linear(f.params, mlp + "up_proj.weight", {mlp + "gate_proj.weight"});
    ADD_FAILURE() << "a fused weight stored out of order was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not stored right after it"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Linear(f.params, mlp + "gate_proj.weight", {mlp + "down_proj.weight"}), Error);
  EXPECT_THROW(Linear(f.params, "model.layers.0.input_layernorm.weight"), Error);  // not a matrix
  EXPECT_EQ(Linear(f.params, "lm_head.weight").split(), plan::Shard::kVocab);
}

class LinearPrecision : public ::testing::TestWithParam<kernels::DType> {};

// forward, backward (dx = and +=, dW +=, a given dW) against double-precision products of the
// operands the GEMMs read: fp32 values, or under bf16 / fp16 the weight's compute copy and the
// inputs rounded to it.
TEST_P(LinearPrecision, GemmsMatchANaiveReferenceOnTheRoundedOperands) {
  const kernels::DType t = GetParam();
  Fixture f;
  const LayerEnv env = f.env(t);
  const std::string mlp = "model.layers.0.mlp.";
  const Linear l(f.params, mlp + "gate_proj.weight", {mlp + "up_proj.weight"});
  EXPECT_EQ(l.low_precision(env), t != kernels::DType::kF32);
  EXPECT_EQ(l.operand_dtype(env), t);
  const int64_t R = 7, O = l.out(), I = l.in();
  const auto x = random_values(R * I, 1), dy = random_values(R * O, 2), y0 = random_values(R * O, 3);
  const auto xr = f.rounded(x, t), dyr = f.rounded(dy, t), w = f.weight_values(l);
  const double tol = 1e-5;

  std::vector<float> y(size_t(R * O));
  l.forward(env, y.data(), x.data(), R);
  expect_close(y, naive(xr, w, R, O, I, true), tol, "y = x W^T");
  std::vector<float> y_acc = y0;
  l.forward(env, y_acc.data(), x.data(), R, 1.0f);
  auto want = naive(xr, w, R, O, I, true);
  for (size_t i = 0; i < want.size(); ++i) want[i] += y0[i];
  expect_close(y_acc, want, tol, "y += x W^T");

  std::fill(l.weight().g, l.weight().g + O * I, 0.0f);
  std::vector<float> dx(size_t(R * I));
  l.backward(env, dx.data(), dy.data(), x.data(), R);
  expect_close(dx, naive(dyr, w, R, I, O, false), tol, "dx = dy W");
  std::vector<float> dyT(size_t(O * R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) dyT[size_t(o * R + r)] = dyr[size_t(r * O + o)];
  const auto dW_want = naive(dyT, xr, O, I, R, false);
  expect_close(std::vector<float>(l.weight().g, l.weight().g + O * I), dW_want, tol, "dW += dy^T x");
  // Into a given dW, with dx accumulated; no dx at all leaves only dW's GEMM.
  std::vector<float> dW(size_t(O * I), 0.0f), dx_acc = dx;
  l.backward(env, dx_acc.data(), dy.data(), x.data(), R, 1.0f, dW.data());
  auto twice = naive(dyr, w, R, I, O, false);
  for (double& v : twice) v *= 2;
  expect_close(dx_acc, twice, tol, "dx += dy W");
  EXPECT_EQ(dW, std::vector<float>(l.weight().g, l.weight().g + O * I));
  std::vector<float> dW2(size_t(O * I), 0.0f);
  l.backward(env, nullptr, dy.data(), x.data(), R, 0.0f, dW2.data());
  EXPECT_EQ(dW2, dW);
}

// The same values as fp32, pinned (rounded once), or in 16 bits only give the same bits; a
// weight gradient deferred to W (zero-bubble schedules) equals the immediate one, bit for bit.
TEST_P(LinearPrecision, EveryFormOfAnInputAndADeferredWeightGradientGiveTheSameBits) {
  const kernels::DType t = GetParam();
  Fixture f;
  const LayerEnv env = f.env(t);
  const Linear l(f.params, "model.layers.0.self_attn.kv_b_proj.weight");
  const int64_t R = 5, O = l.out(), I = l.in();
  const auto x = random_values(R * I, 4), dy = random_values(R * O, 5);
  std::vector<float> y1(size_t(R * O)), y2(size_t(R * O));
  l.forward(env, y1.data(), x.data(), R);
  l.forward(env, y2.data(), l.pin(env, x.data(), R), R);
  EXPECT_EQ(y1, y2) << "pinned";
  std::vector<uint16_t> x16(size_t(R * I));
  if (t != kernels::DType::kF32) {
    f.be->convert({x16.data(), t, {R * I}}, {kernels::f32(x.data()), {R * I}});
    std::fill(y2.begin(), y2.end(), 0.0f);
    l.forward(env, y2.data(), GemmInput::rounded({x16.data(), t}), R);
    EXPECT_EQ(y1, y2) << "16-bit only";
  } else {
    EXPECT_THROW(l.forward(env, y2.data(), GemmInput::rounded({x16.data(), kernels::DType::kBF16}), R), Error);
  }
  std::vector<float> dW_now(size_t(O * I), 0.0f), dW_later(size_t(O * I), 0.0f), dx1(size_t(R * I)),
      dx2(size_t(R * I));
  l.backward(env, dx1.data(), dy.data(), x.data(), R, 0.0f, dW_now.data());
  WeightGradDeferral d(*f.be);
  {
    const WeightGradDeferral::Scope scope(&d);
    EXPECT_FALSE(l.dy_in_16bit(env));  // a deferred GEMM keeps dy in fp32
    l.backward(env, dx2.data(), dy.data(), x.data(), R, 0.0f, dW_later.data());
  }
  EXPECT_EQ(dx1, dx2);
  EXPECT_EQ(dW_later, std::vector<float>(size_t(O * I), 0.0f)) << "ran before W";
  d.run();
  EXPECT_EQ(dW_later, dW_now);
  EXPECT_EQ(l.dy_in_16bit(env), t != kernels::DType::kF32);
}

INSTANTIATE_TEST_SUITE_P(Types, LinearPrecision,
                         ::testing::Values(kernels::DType::kF32, kernels::DType::kBF16, kernels::DType::kF16),
                         [](const auto& info) { return std::string(kernels::to_string(info.param)); });

}  // namespace
}  // namespace dstrain::model
