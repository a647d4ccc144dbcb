// The CPU backend's low-precision building blocks (kernels/cpu/low_precision.h): conversions
// checked on every bf16 / fp16 value (round trip, ties to even at every midpoint, overflow, NaN),
// the vector paths against the scalar ones, and the GEMMs on bf16 / fp16 inputs against a
// double-precision product of the same rounded inputs (fp32 accumulation: 1e-5 of sum |a||b|)
// and against the fp32 product (the inputs' rounding: 2^-8 for bf16, 2^-11 for fp16).
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/low_precision.h"

namespace dstrain::kernels::cpu {
namespace {

using Conv = uint16_t (*)(float);
using Back = float (*)(uint16_t);

bool is_nan16(uint16_t h, LowPrecision p) {
  return p == LowPrecision::kBf16 ? (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0 : (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
}
bool is_inf16(uint16_t h, LowPrecision p) {
  return p == LowPrecision::kBf16 ? (h & 0x7fff) == 0x7f80 : (h & 0x7fff) == 0x7c00;
}

void check_every_value(LowPrecision p) {
  const Conv to = p == LowPrecision::kBf16 ? to_bf16 : to_fp16;
  const Back from = p == LowPrecision::kBf16 ? from_bf16 : from_fp16;
  int checked_ties = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint16_t v = uint16_t(h);
    if (is_nan16(v, p)) {
      EXPECT_TRUE(std::isnan(from(v)));
      EXPECT_TRUE(is_nan16(to(from(v)), p)) << h;
      continue;
    }
    ASSERT_EQ(to(from(v)), v) << to_string(p) << " value " << h << " does not round-trip";
    // The midpoint to the next value of larger magnitude (same sign) rounds to the even code;
    // just below it to v, just above it to the next.
    const uint16_t next = uint16_t(h + 1);
    if (is_inf16(v, p) || is_inf16(next, p) || is_nan16(next, p)) continue;
    if ((h & 0x7fff) == 0x7fff) continue;
    const double lo = from(v), hi = from(next);
    const float mid = float((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2) << "midpoint not exact";
    EXPECT_EQ(to(mid), (v & 1) ? next : v) << to_string(p) << " tie above " << h;
    EXPECT_EQ(to(std::nextafter(mid, float(lo))), v) << h;
    EXPECT_EQ(to(std::nextafter(mid, float(hi))), next) << h;
    ++checked_ties;
  }
  EXPECT_GT(checked_ties, 60000);
}

TEST(LowPrecision, Bf16EveryValueRoundTripsAndTiesGoToEven) {
  check_every_value(LowPrecision::kBf16);
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_EQ(to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(to_bf16(1.0f), 0x3f80);
}

TEST(LowPrecision, Fp16EveryValueRoundTripsAndTiesGoToEven) {
  check_every_value(LowPrecision::kFp16);
  EXPECT_EQ(to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(to_fp16(65519.0f), 0x7bff);
  EXPECT_EQ(to_fp16(65520.0f), 0x7c00);  // the tie above the largest finite value goes to inf
  EXPECT_EQ(to_fp16(-1e9f), 0xfc00);
  EXPECT_EQ(to_fp16(5.9604645e-8f), 0x0001);  // 2^-24, the smallest subnormal
  EXPECT_EQ(to_fp16(2.9802322e-8f), 0x0000);  // 2^-25: the tie rounds to even zero
  EXPECT_EQ(to_fp16(1.0f), 0x3c00);
}

// The array path (AVX512-BF16, or the integer AVX2 rounding) gives the scalar rounding's bits
// exactly, NaN payloads included, on random 32-bit patterns of every class and on ties, at
// every offset inside a vector block (odd array lengths, unaligned starts).
TEST(LowPrecision, Bf16ArrayRoundingEqualsTheScalarBitForBit) {
  std::mt19937 rng(17);
  std::vector<uint32_t> u(200003);
  for (auto& v : u) v = uint32_t(rng());
  for (size_t i = 0; i < 4096; ++i) u[i] = (u[i] & 0xffff0000u) | 0x8000u;  // ties: even or odd kept bit
  for (size_t i = 4096; i < 4160; ++i) u[i] = 0x7f7f8000u + uint32_t(i % 2) * 0x10000u;  // ties at the top binade
  const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0xff7fffffu,
                               0x7fc00000u, 0xffc00001u, 0x7f800001u, 0xff80ffffu, 0x00000001u, 0x807fffffu,
                               0x3f807fffu, 0x3f808000u, 0x3f818000u, 0x3f80ffffu};
  for (size_t i = 0; i < std::size(specials); ++i) u[5000 + 3 * i] = specials[i];
  std::vector<float> x(u.size());
  std::memcpy(x.data(), u.data(), u.size() * 4);
  for (const int64_t start : {0, 1, 7, 15}) {
    const int64_t n = int64_t(x.size()) - start;
    std::vector<uint16_t> h(static_cast<size_t>(n));
    convert_to(h.data(), x.data() + start, n, LowPrecision::kBf16);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[size_t(start + i)];
      uint32_t b;
      std::memcpy(&b, &v, 4);
      if (h[size_t(i)] != to_bf16(v) && wrong++ < 5) ADD_FAILURE() << std::hex << b << " -> " << h[size_t(i)] << " not " << to_bf16(v);
    }
    EXPECT_EQ(wrong, 0) << "start " << start;
  }
  EXPECT_EQ(to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie, kept bit even: down
  EXPECT_EQ(to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie, kept bit odd: up
  EXPECT_EQ(to_bf16(std::bit_cast<float>(0xffc00001u)), 0xffc0);  // a NaN keeps its sign and stays quiet
}

TEST(LowPrecision, ArrayConversionsEqualTheScalarOnes) {
  std::mt19937 rng(7);
  std::vector<float> x(1003);
  std::uniform_real_distribution<float> e(-30.f, 30.f);
  for (auto& v : x) v = std::ldexp(std::uniform_real_distribution<float>(-1.f, 1.f)(rng), int(e(rng)));
  x[5] = std::numeric_limits<float>::quiet_NaN(), x[6] = std::numeric_limits<float>::infinity(), x[7] = 1e6f;
  // Subnormal floats inside vector blocks (the AVX512-BF16 instruction would flush them) and tiny
  // values that round to fp16 / bf16 subnormals.
  for (size_t i = 100; i < 132; ++i) x[i] = std::ldexp(float(int(i) - 115), -140 + int(i % 7));
  for (size_t i = 200; i < 216; ++i) x[i] = std::ldexp(1.5f, -20 - int(i % 8));
  for (LowPrecision p : {LowPrecision::kBf16, LowPrecision::kFp16}) {
    std::vector<uint16_t> h(x.size());
    std::vector<float> back(x.size());
    convert_to(h.data(), x.data(), int64_t(x.size()), p);
    convert_from(back.data(), h.data(), int64_t(x.size()), p);
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t want = p == LowPrecision::kBf16 ? to_bf16(x[i]) : to_fp16(x[i]);
      if (is_nan16(want, p)) {
        EXPECT_TRUE(is_nan16(h[i], p)) << i;
        continue;
      }
      EXPECT_EQ(h[i], want) << to_string(p) << " " << i << " " << x[i];
      const float w = p == LowPrecision::kBf16 ? from_bf16(h[i]) : from_fp16(h[i]);
      EXPECT_EQ(back[i], w) << i;
    }
  }
}

// DSTRAIN_LOWP_GEMM set for one scope (each LowPrecisionGemm decides once, when first asked).
// `be`'s kernel options (Backend::set_options) with some fields changed, for one scope.
class WithOptions {
 public:
  WithOptions(Backend& be, const std::function<void(KernelOptions&)>& change) : be_(be), saved_(be.options()) {
    KernelOptions o = saved_;
    change(o);
    be.set_options(o);
  }
  ~WithOptions() { be_.set_options(saved_); }

 private:
  Backend& be_;
  KernelOptions saved_;
};
KernelOptions native_lowp() {
  KernelOptions o;
  o.lowp_gemm = "native";  // the 16-bit paths even where the CPU's rule would widen
  return o;
}

// Both paths — oneDNN's native matmul and the widened sgemm — whichever the measurement picks.
class LowPrecisionGemmPath : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Paths, LowPrecisionGemmPath, ::testing::Values("native", "widened"));

TEST_P(LowPrecisionGemmPath, GemmOnRoundedInputsAccumulatesInFp32) {
  LowPrecisionGemm gemm(GetParam());
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.f, 1.f);
  const int64_t M = 37, N = 19, K = 301;
  for (LowPrecision p : {LowPrecision::kBf16, LowPrecision::kFp16})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true}) {
        std::vector<float> a(M * K), b(K * N), c(M * N), c0(M * N);
        for (auto& v : a) v = d(rng);
        for (auto& v : b) v = d(rng);
        for (auto& v : c0) v = d(rng);
        std::vector<uint16_t> ah(a.size()), bh(b.size());
        convert_to(ah.data(), a.data(), int64_t(a.size()), p);
        convert_to(bh.data(), b.data(), int64_t(b.size()), p);
        std::vector<float> ar(a.size()), br(b.size());
        convert_from(ar.data(), ah.data(), int64_t(a.size()), p);
        convert_from(br.data(), bh.data(), int64_t(b.size()), p);
        const float alpha = 0.5f, beta = 0.25f;
        c = c0;
        gemm.run(c.data(), ah.data(), bh.data(), M, N, K, ta, tb, alpha, beta, p);
        const double input_eps = p == LowPrecision::kBf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double rounded = 0, exact = 0, mag = 0;
            for (int64_t k = 0; k < K; ++k) {
              const int64_t ia = ta ? k * M + i : i * K + k, ib = tb ? j * K + k : k * N + j;
              rounded += double(ar[ia]) * br[ib];
              exact += double(a[ia]) * b[ib];
              mag += std::fabs(double(a[ia]) * b[ib]);
            }
            const double got = c[i * N + j], base = beta * double(c0[i * N + j]);
            EXPECT_NEAR(got, alpha * rounded + base, 1e-5 * alpha * mag + 1e-6)
                << to_string(p) << " ta " << ta << " tb " << tb << " at " << i << "," << j;
            EXPECT_NEAR(got, alpha * exact + base, input_eps * alpha * mag) << to_string(p);
          }
      }
  // and the 768^3 shape of the choice of each type oneDNN has a matmul for (none on AVX2-only
  // CPUs such as Zen 3; bf16 on the AVX512-BF16 and AMX machines seen here)
  int64_t with_matmul = 0;
  {
    LowPrecisionGemm probe;
    for (LowPrecision p : {LowPrecision::kBf16, LowPrecision::kFp16}) with_matmul += probe.has_native_matmul(p);
  }
  EXPECT_EQ(gemm.cached_shapes(), 8 + with_matmul);
  std::vector<float> c(4, 3.0f);
  std::vector<uint16_t> none;
  gemm.run(c.data(), none.data(), none.data(), 2, 2, 0, false, false, 1.0f, 0.5f, LowPrecision::kBf16);
  EXPECT_EQ(c, std::vector<float>(4, 1.5f));  // K = 0: C = beta C
  EXPECT_FALSE(gemm.implementation(64, 64, 64, false, true, LowPrecision::kBf16).empty());
  EXPECT_FALSE(onednn_isa().empty());
}

TEST(LowPrecision, TheGemmPathIsRuledOrForcedAndNonsenseIsRefused) {
  for (const LowPrecision p : {LowPrecision::kBf16, LowPrecision::kFp16}) {
    LowPrecisionGemm probe;
    const bool has_native = probe.implementation(64, 64, 64, false, true, p).find("widened") == std::string::npos ||
                            probe.native_speedup(p) > 0;  // measured: oneDNN has the matmul
    EXPECT_EQ(LowPrecisionGemm().has_native_matmul(p), has_native) << to_string(p);
    if (onednn_isa() == "avx2" || onednn_isa() == "avx2_vnni") {
      EXPECT_FALSE(has_native) << to_string(p);
    }
    {
      LowPrecisionGemm g("widened");
      EXPECT_FALSE(g.native(p));
      EXPECT_FALSE(g.operands_16bit(p));
      EXPECT_NE(g.implementation(64, 64, 64, false, true, p).find("widened to fp32"), std::string::npos);
    }
    {
      LowPrecisionGemm g("native");
      EXPECT_EQ(g.native(p), has_native) << to_string(p);  // native only where oneDNN has it
      EXPECT_TRUE(g.operands_16bit(p)) << to_string(p);    // but 16-bit operands on every CPU
      const std::string impl = g.implementation(64, 64, 64, false, true, p);
      EXPECT_EQ(impl.find("on 16-bit operands") != std::string::npos, !has_native) << impl;
      // and the same products either way (K = 96: exact in fp32 for these small integers)
      const int64_t n = 16, k = 96;
      std::vector<uint16_t> a(size_t(n * k)), b(size_t(n * k));
      for (int64_t i = 0; i < n * k; ++i) {
        const float x = float(i % 5 - 2), y = float(i % 3 - 1);
        a[size_t(i)] = p == LowPrecision::kBf16 ? to_bf16(x) : to_fp16(x);
        b[size_t(i)] = p == LowPrecision::kBf16 ? to_bf16(y) : to_fp16(y);
      }
      std::vector<float> c(size_t(n * n));
      g.run(c.data(), a.data(), b.data(), n, n, k, false, true, 1.0f, 0.0f, p);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double want = 0;
          for (int64_t q = 0; q < k; ++q) want += double((i * k + q) % 5 - 2) * double((j * k + q) % 3 - 1);
          ASSERT_EQ(c[size_t(i * n + j)], float(want)) << to_string(p) << " " << i << "," << j;
        }
    }
    {
      LowPrecisionGemm g("auto");  // the CPU's rule; the measurement stated in the implementation
      const std::string impl = g.implementation(64, 64, 64, false, true, p);
      EXPECT_EQ(g.operands_16bit(p), g.native(p)) << to_string(p);
      if (g.native(p)) {
        EXPECT_EQ(impl.find("widened"), std::string::npos) << impl;
      } else if (has_native) {
        EXPECT_NE(impl.find("measured"), std::string::npos) << impl;
      }
    }
  }
  // anything else is refused, on every CPU, oneDNN's matmul or not
  EXPECT_THROW(LowPrecisionGemm("fastest"), std::invalid_argument);
  LowPrecisionGemm g;
  EXPECT_THROW(g.set_choice("fastest"), std::invalid_argument);
  auto be = make_cpu_backend(1);
  KernelOptions o;
  o.lowp_gemm = "fastest";
  try {
    be->set_options(o);
    ADD_FAILURE() << "kernels.lowp_gemm fastest accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("valid: auto, native, widened"), std::string::npos) << e.what();
  }
}

// The choice between native and widened 16-bit GEMMs — and so every GEMM's numerics — is the
// same however busy the machine is: made while both cores spin, it equals the choice made
// before, on every one of several fresh instances (a timed choice flipped under such load).
TEST(LowPrecision, TheGemmPathDoesNotDependOnTheMachinesLoad) {
  for (const LowPrecision p : {LowPrecision::kBf16, LowPrecision::kFp16}) {
    const bool quiet = LowPrecisionGemm().native(p);
    std::atomic<bool> stop{false};
    std::vector<std::thread> spin;
    for (unsigned t = 0; t < 2 * std::max(1u, std::thread::hardware_concurrency()); ++t)
      spin.emplace_back([&] {
        volatile double x = 1;
        while (!stop.load(std::memory_order_relaxed)) x = x * 1.0000001 + 1e-9;
      });
    std::vector<bool> busy;
    for (int i = 0; i < 6; ++i) busy.push_back(LowPrecisionGemm().native(p));
    stop = true;
    for (std::thread& t : spin) t.join();
    for (int i = 0; i < 6; ++i) EXPECT_EQ(busy[size_t(i)], quiet) << to_string(p) << ", instance " << i;
  }
}

// The typed interface of kernels::Backend (docs/design.md §6.1): conversions by view type, the
// GEMMs on low-precision views (fixed shapes and the experts' run-time shapes) equal to the
// building blocks above, device memory and the host copies.
TEST(BackendTyped, ConvertGemmAndGroupedGemmMatchTheBuildingBlocks) {
  auto be = make_cpu_backend(2);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.f, 1.f);
  for (const DType t : {DType::kBF16, DType::kF16}) {
    const LowPrecision p = t == DType::kBF16 ? LowPrecision::kBf16 : LowPrecision::kFp16;
    // Conversions: over several of the backend's blocks, against the scalar code.
    std::vector<float> x(10007), back(x.size());
    for (auto& v : x) v = d(rng) * 100.0f;
    std::vector<uint16_t> h(x.size());
    be->convert({h.data(), t, {int64_t(x.size())}}, {f32(x.data()), {int64_t(x.size())}});
    be->convert({back.data(), DType::kF32, {int64_t(x.size())}}, {h.data(), t, {int64_t(x.size())}});
    for (size_t i = 0; i < x.size(); ++i) {
      const uint16_t want = p == LowPrecision::kBf16 ? to_bf16(x[i]) : to_fp16(x[i]);
      ASSERT_EQ(h[i], want) << i;
      ASSERT_EQ(back[i], p == LowPrecision::kBf16 ? from_bf16(want) : from_fp16(want)) << i;
    }
    EXPECT_THROW(be->convert({h.data(), DType::kBF16, {4}}, {h.data(), DType::kF16, {4}}), std::invalid_argument);
    // A typed GEMM equals the fp32 GEMM of the widened inputs to fp32 accumulation.
    const int64_t M = 33, N = 70, K = 129;
    std::vector<float> a(M * K), b(N * K), c(M * N), ref(M * N);
    for (auto& v : a) v = d(rng);
    for (auto& v : b) v = d(rng);
    std::vector<uint16_t> ah(a.size()), bh(b.size());
    be->convert({ah.data(), t, {int64_t(a.size())}}, {f32(a.data()), {int64_t(a.size())}});
    be->convert({bh.data(), t, {int64_t(b.size())}}, {f32(b.data()), {int64_t(b.size())}});
    std::vector<float> aw(a.size()), bw(b.size());
    be->convert({aw.data(), DType::kF32, {int64_t(a.size())}}, {ah.data(), t, {int64_t(a.size())}});
    be->convert({bw.data(), DType::kF32, {int64_t(b.size())}}, {bh.data(), t, {int64_t(b.size())}});
    be->gemm({c.data(), {M, N}}, {ConstView{ah.data(), t}, {M, K}}, {ConstView{bh.data(), t}, {N, K}}, false, true,
             1.0f, 0.0f);
    be->gemm({ref.data(), {M, N}}, {aw.data(), {M, K}}, {bw.data(), {N, K}}, false, true, 1.0f, 0.0f);
    for (int64_t i = 0; i < M * N; ++i) {
      double mag = 0;
      for (int64_t k = 0; k < K; ++k) mag += std::fabs(double(aw[i / N * K + k]) * bw[i % N * K + k]);
      ASSERT_NEAR(c[i], ref[i], 1e-5 * mag) << to_string(t) << " " << i;
    }
    // fp32 views take the fp32 path: bitwise the plain GEMM.
    std::vector<float> c32(M * N);
    be->gemm({c32.data(), {M, N}}, {f32(aw.data()), {M, K}}, {f32(bw.data()), {N, K}}, false, true, 1.0f, 0.0f);
    EXPECT_EQ(c32, ref);
    EXPECT_THROW(be->gemm({c.data(), {M, N}}, {f32(a.data()), {M, K}}, {ConstView{bh.data(), t}, {N, K}}, false, true,
                          1.0f, 0.0f),
                 std::invalid_argument);
    // Grouped, with row counts that change from call to call (run-time shapes), beta 1
    // accumulating: each problem equals its own typed GEMM.
    for (const int64_t rows0 : {int64_t(3), int64_t(13)}) {  // rows0 + rows0 + 5 <= M
      const int64_t rows[3] = {rows0, 0, rows0 + 5};
      std::vector<float> g(size_t((rows[0] + rows[2]) * N), 1.0f), single = g;
      std::vector<float*> C = {g.data(), g.data(), g.data() + rows[0] * N};
      std::vector<const void*> A = {ah.data(), ah.data(), ah.data() + rows[0] * K}, B = {bh.data(), bh.data(), bh.data()};
      const int64_t Ms[3] = {rows[0], rows[1], rows[2]}, Ns[3] = {N, N, N}, Ks[3] = {K, K, K};
      be->gemm_grouped(gemm_problems(C.data(), A.data(), B.data(), t, Ms, Ns, Ks, 3, false, true), false, true, 1.0f, 1.0f);
      be->gemm({single.data(), {rows[0], N}}, {ConstView{ah.data(), t}, {rows[0], K}},
               {ConstView{bh.data(), t}, {N, K}}, false, true, 1.0f, 1.0f);
      be->gemm({single.data() + rows[0] * N, {rows[2], N}}, {ConstView{ah.data() + rows[0] * K, t}, {rows[2], K}},
               {ConstView{bh.data(), t}, {N, K}}, false, true, 1.0f, 1.0f);
      for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], single[i], 1e-4 * (1 + std::fabs(single[i]))) << i;
    }
    // Many problems (at least twice the threads: one problem per thread at a time where the
    // matmul is native), forward-like (rows vary, B transposed) and weight-gradient-like (A
    // transposed, the summed rows vary), alpha and beta: each equals its own typed GEMM.
    for (const bool weight_grad : {false, true}) {
      const int64_t count = 9;
      std::vector<int64_t> Ms(count), Ns(count), Ks(count);
      std::vector<std::vector<uint16_t>> As(count), Bs(count);
      std::vector<std::vector<float>> Cs(count), Ref(count);
      std::vector<float*> C(count);
      std::vector<const void*> A(count), B(count);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t varying = (i * 7) % 23;  // 0 included
        Ms[i] = weight_grad ? 24 : varying, Ns[i] = 40, Ks[i] = weight_grad ? varying : 56;
        As[i].resize(size_t(Ms[i] * Ks[i])), Bs[i].resize(size_t(Ks[i] * Ns[i]));
        for (auto* v : {&As[i], &Bs[i]})
          for (auto& e : *v) e = p == LowPrecision::kBf16 ? to_bf16(d(rng)) : to_fp16(d(rng));
        Cs[i].assign(size_t(Ms[i] * Ns[i]), 0.5f);
        Ref[i] = Cs[i];
        C[i] = Cs[i].data(), A[i] = As[i].data(), B[i] = Bs[i].data();
      }
      const bool ta = weight_grad, tb = !weight_grad;
      be->gemm_grouped(gemm_problems(C.data(), A.data(), B.data(), t, Ms.data(), Ns.data(), Ks.data(), count, ta, tb), ta, tb, 0.5f, 1.0f);
      for (int64_t i = 0; i < count; ++i) {
        be->gemm({Ref[i].data(), {Ms[i], Ns[i]}},
                 {ConstView{As[i].data(), t},
                  ta ? dstrain::kernels::Dims{Ks[i], Ms[i]} : dstrain::kernels::Dims{Ms[i], Ks[i]}},
                 {ConstView{Bs[i].data(), t},
                  tb ? dstrain::kernels::Dims{Ns[i], Ks[i]} : dstrain::kernels::Dims{Ks[i], Ns[i]}},
                 ta, tb, 0.5f, 1.0f);
        for (size_t j = 0; j < Ref[i].size(); ++j)
          ASSERT_NEAR(Cs[i][j], Ref[i][j], 1e-4 * (1 + std::fabs(Ref[i][j]))) << to_string(t) << " " << i << " " << j;
      }
    }
    EXPECT_FALSE(be->lowp_gemm_implementation(t).empty());
  }
  // Device memory: aligned, and the host reads and writes it only by copies.
  DeviceBuffer buf(*be, 1000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 64, 0u);
  std::vector<int32_t> in(250), out(250);
  for (int i = 0; i < 250; ++i) in[size_t(i)] = i * 7 - 3;
  be->copy_from_host(buf.data(), in.data(), 1000);
  be->synchronize();
  be->copy_to_host(out.data(), buf.data(), 1000);
  EXPECT_EQ(out, in);
  DeviceBuffer moved = std::move(buf);
  EXPECT_EQ(buf.data(), nullptr);
  EXPECT_EQ(moved.bytes(), 1000);
}

void check_attention_against_fp32(Backend& backend, int64_t S);

// Both tile engines of the 16-bit attention: oneDNN matmuls and the AMX tile products.
class LowPrecisionAttention : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Tiles, LowPrecisionAttention, ::testing::Values("onednn", "amx"));

// 16-bit attention (bf16 where oneDNN has a native matmul, or AMX) against the fp32 kernel on
// the same rounded Q, K, V (and dO): the only differences are the rounding of P and dS before
// their GEMMs, so outputs and gradients agree to a few bf16 ulps of their scale; the
// log-sum-exp, from fp32 scores of exactly representable inputs, to fp32 accuracy. Several query
// tiles, an odd sequence length, dqk != dv, neither a multiple of 32; S = 300 also gives the
// AMX backward pass two blocks of keys.
TEST_P(LowPrecisionAttention, MatchesFp32OnRoundedInputs) {
  if (std::string(GetParam()) == "amx" && !amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  auto be = make_cpu_backend(2);
  KernelOptions o = native_lowp();  // the 16-bit tile GEMMs even where widening is faster
  o.cpu_attention = GetParam();
  be->set_options(o);
  if (!be->low_precision_attention(DType::kBF16)) GTEST_SKIP() << "no bf16 matmul on this CPU";
  EXPECT_FALSE(be->low_precision_attention(DType::kF32));
  for (const int64_t S : {150, 300}) {
    SCOPED_TRACE("S = " + std::to_string(S));
    check_attention_against_fp32(*be, S);
  }
}

void check_attention_against_fp32(Backend& backend, int64_t S) {
  Backend* be = &backend;
  const int64_t B = 2, nh = 3, dqk = 40, dv = 24, N = B * S;
  const float scale = 1.0f / std::sqrt(float(dqk));
  be->reserve_attention(S);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.f, 1.f);
  const auto rounded = [&](int64_t n, std::vector<uint16_t>& h) {
    std::vector<float> x(static_cast<size_t>(n));
    for (auto& v : x) v = 2.0f * d(rng);
    h.resize(x.size());
    be->convert({h.data(), DType::kBF16, {n}}, {f32(x.data()), {n}});
    be->convert({x.data(), DType::kF32, {n}}, {h.data(), DType::kBF16, {n}});
    return x;
  };
  std::vector<uint16_t> q16, k16, v16, do16;
  const auto Q = rounded(N * nh * dqk, q16), K = rounded(N * nh * dqk, k16), V = rounded(N * nh * dv, v16);
  const auto dO = rounded(N * nh * dv, do16);
  std::vector<float> O(size_t(N * nh * dv)), lse(size_t(N * nh)), O32 = O, lse32 = lse;
  const ConstView q{q16.data(), DType::kBF16}, k{k16.data(), DType::kBF16}, v{v16.data(), DType::kBF16};
  be->attention_forward({O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, {q, {B, S, nh, dqk}},
                        {k, {B, S, nh, dqk}}, {v, {B, S, nh, dv}}, scale);
  be->attention_forward({O32.data(), {B, S, nh, dv}}, {lse32.data(), {B, nh, S}}, {Q.data(), {B, S, nh, dqk}},
                        {K.data(), {B, S, nh, dqk}}, {V.data(), {B, S, nh, dv}}, scale);
  const auto close = [](const std::vector<float>& got, const std::vector<float>& want, double rel, const char* what) {
    double scale = 0;
    for (float w : want) scale = std::max(scale, double(std::fabs(w)));
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], rel * scale) << what << " " << i;
  };
  close(lse, lse32, 1e-5, "lse");
  close(O, O32, std::ldexp(1.0, -7), "O");  // P rounded to bf16 (8 significant bits) before P V
  std::vector<float> dQ(Q.size()), dK(K.size()), dV(V.size()), dQ32 = dQ, dK32 = dK, dV32 = dV;
  be->attention_backward({dQ.data(), {B, S, nh, dqk}}, {dK.data(), {B, S, nh, dqk}}, {dV.data(), {B, S, nh, dv}},
                         {dO.data(), {B, S, nh, dv}}, {do16.data(), DType::kBF16, {B, S, nh, dv}}, {q, {B, S, nh, dqk}},
                         {k, {B, S, nh, dqk}}, {v, {B, S, nh, dv}}, {O32.data(), {B, S, nh, dv}},
                         {lse32.data(), {B, nh, S}}, scale);
  be->attention_backward({dQ32.data(), {B, S, nh, dqk}}, {dK32.data(), {B, S, nh, dqk}}, {dV32.data(), {B, S, nh, dv}},
                         {dO.data(), {B, S, nh, dv}}, {}, {Q.data(), {B, S, nh, dqk}}, {K.data(), {B, S, nh, dqk}},
                         {V.data(), {B, S, nh, dv}}, {O32.data(), {B, S, nh, dv}}, {lse32.data(), {B, nh, S}}, scale);
  close(dV, dV32, std::ldexp(1.0, -7), "dV");
  close(dQ, dQ32, std::ldexp(1.0, -6), "dQ");  // dS rounded too: a difference of two terms
  close(dK, dK32, std::ldexp(1.0, -6), "dK");
  // Mixed view types are refused.
  EXPECT_THROW(be->attention_forward({O.data(), {B, S, nh, dv}}, {lse.data(), {B, nh, S}}, {q, {B, S, nh, dqk}},
                                     {k, {B, S, nh, dqk}}, {ConstView{v16.data(), DType::kF16}, {B, S, nh, dv}}, scale),
               std::invalid_argument);
}

// The AMX tile products against a double-precision product of the same bf16 values: B packed
// both ways (from rows and transposed), K and N not whole tiles (zeros padded in), M one and
// several pairs of row tiles, with and without accumulation; padded columns come out as the
// zeros they multiply (plus C when accumulating).
TEST(Amx, TileProductsMatchADoubleReference) {
  if (!amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.f, 1.f);
  struct Case {
    int64_t M, N, K;
    bool transposed, accumulate;
  };
  for (const Case c : {Case{16, 16, 32, false, false}, Case{48, 40, 40, true, true}, Case{64, 96, 96, false, true},
                       Case{96, 72, 200, true, false}, Case{32, 130, 64, false, false}}) {
    SCOPED_TRACE(::testing::Message() << c.M << " x " << c.N << " x " << c.K << (c.transposed ? " T" : "")
                                      << (c.accumulate ? " +C" : ""));
    const int64_t Kp = (c.K + 31) / 32 * 32, Np = (c.N + 15) / 16 * 16;
    std::vector<uint16_t> A(size_t(c.M * Kp), 0), src(size_t(c.K * c.N)), Bv(size_t(Kp * Np), 0xffff);
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t k = 0; k < c.K; ++k) A[size_t(i * Kp + k)] = to_bf16(d(rng));
    for (auto& v : src) v = to_bf16(d(rng));
    const auto b = [&](int64_t k, int64_t n) { return from_bf16(src[size_t(c.transposed ? n * c.K + k : k * c.N + n)]); };
    vnni_pack(Bv.data(), Kp * 16, src.data(), c.transposed ? c.K : c.N, c.K, c.N, Kp, Np, c.transposed);
    std::vector<float> C(size_t(c.M * Np));
    for (auto& v : C) v = d(rng);
    const std::vector<float> C0 = C;
    amx_gemm(C.data(), Np, A.data(), Kp, Bv.data(), Kp * 16, c.M, Np, Kp, c.accumulate);
    for (int64_t i = 0; i < c.M; ++i) {
      for (int64_t n = 0; n < Np; ++n) {
        double want = c.accumulate ? C0[size_t(i * Np + n)] : 0.0, mag = std::fabs(want);
        for (int64_t k = 0; k < c.K && n < c.N; ++k) {
          const double t = double(from_bf16(A[size_t(i * Kp + k)])) * b(k, n);
          want += t, mag += std::fabs(t);
        }
        ASSERT_NEAR(C[size_t(i * Np + n)], want, 1e-5 * mag + 1e-30) << i << ", " << n;
      }
    }
  }
}

// A whole GEMM on the tile unit, A and B as they are and transposed, sizes off the tiles'
// multiples in M, N and K (tail rows through the padded tile, N % 16 != 0 through the row
// buffer, K padded; A^T: columns of A past a 16-column block, K past a 32-row block), on whole
// tiles (A read in place), and K long enough to go in chunks (1700: 768 + 768 + 164): against a
// double-precision product of the same bf16 values; the elements past C's end untouched.
TEST(Amx, MatmulMatchesADoubleReference) {
  if (!amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  std::mt19937 rng(12);
  std::normal_distribution<float> d(0.f, 1.f);
  struct Shape {
    int64_t M, N, K;
  };
  for (const Shape sh : {Shape{37, 45, 70}, Shape{64, 32, 64}, Shape{50, 48, 96}, Shape{5, 7, 3}, Shape{33, 16, 33},
                         Shape{0, 16, 32}, Shape{16, 16, 0}, Shape{40, 24, 130},
                         Shape{48, 40, 1700}})
    for (const bool ta : {false, true})
      for (const bool tb : {false, true})
        for (const bool acc : {false, true}) {
          SCOPED_TRACE(::testing::Message() << sh.M << " x " << sh.N << " x " << sh.K << (ta ? " A^T" : "")
                                            << (tb ? " B^T" : "") << (acc ? " +C" : ""));
          const int64_t M = sh.M, N = sh.N, K = sh.K;
          std::vector<uint16_t> A(size_t(M * K)), B(size_t(K * N));
          for (auto& v : A) v = to_bf16(d(rng));
          for (auto& v : B) v = to_bf16(d(rng));
          const auto a = [&](int64_t i, int64_t k) { return double(from_bf16(A[size_t(ta ? k * M + i : i * K + k)])); };
          const auto b = [&](int64_t k, int64_t n) { return double(from_bf16(B[size_t(tb ? n * K + k : k * N + n)])); };
          std::vector<float> C(size_t(M * N + 8));
          for (auto& v : C) v = d(rng);
          const std::vector<float> C0 = C;
          const AmxMatmulWorkspace need = amx_matmul_workspace(M, N, K, ta);
          std::vector<uint16_t> w16(size_t(need.u16), 0xffff);  // garbage: every padding is written
          std::vector<float> w32(size_t(need.f32), std::nanf(""));
          amx_matmul(C.data(), A.data(), B.data(), M, N, K, ta, tb, acc, w16.data(), w32.data());
          for (int64_t i = 0; i < M; ++i)
            for (int64_t n = 0; n < N; ++n) {
              double want = acc ? C0[size_t(i * N + n)] : 0.0, mag = std::fabs(want);
              for (int64_t k = 0; k < K; ++k) want += a(i, k) * b(k, n), mag += std::fabs(a(i, k) * b(k, n));
              ASSERT_NEAR(C[size_t(i * N + n)], want, 1e-5 * mag + 1e-30) << i << ", " << n;
            }
          for (size_t i = size_t(M * N); i < C.size(); ++i) ASSERT_EQ(C[i], C0[i]) << "past C's end, " << i;
        }
}

// The backend's grouped bf16 GEMM (the experts') on the AMX unit against the same problems on
// oneDNN: forward-like (B transposed), input-gradient-like and weight-gradient-like (A
// transposed, the rows summed), row counts 0 to 40, beta 0 and 1; a bad engine name refused.
TEST(Amx, GroupedGemmMatchesOneDnn) {
  if (!amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  auto be = make_cpu_backend(2);
  be->set_options(native_lowp());
  if (!be->low_precision_gemm_native(DType::kBF16)) GTEST_SKIP() << "no native bf16 matmul";
  std::mt19937 rng(13);
  std::normal_distribution<float> d(0.f, 1.f);
  const int64_t count = 7, H = 48, I = 40;
  struct Kind {
    bool ta, tb;
    float beta;
  };
  for (const Kind kind : {Kind{false, true, 0.0f}, Kind{false, false, 1.0f}, Kind{true, false, 1.0f}}) {
    SCOPED_TRACE(::testing::Message() << (kind.ta ? "A^T " : "") << (kind.tb ? "B^T " : "") << "beta " << kind.beta);
    std::vector<int64_t> Ms(count), Ns(count), Ks(count);
    std::vector<std::vector<uint16_t>> As(count), Bs(count);
    std::vector<std::vector<float>> C0(count);
    for (int64_t i = 0; i < count; ++i) {
      const int64_t rows = (i * 13) % 41;  // 0 included
      Ms[i] = kind.ta ? I : rows, Ns[i] = kind.ta ? H : kind.tb ? I : H, Ks[i] = kind.ta ? rows : kind.tb ? H : I;
      As[i].resize(size_t(Ms[i] * Ks[i])), Bs[i].resize(size_t(Ks[i] * Ns[i]));
      for (auto* v : {&As[i], &Bs[i]})
        for (auto& e : *v) e = to_bf16(d(rng));
      C0[i].resize(size_t(Ms[i] * Ns[i]));
      for (auto& e : C0[i]) e = d(rng);
    }
    const auto run = [&](const char* engine) {
      const WithOptions use(*be, [&](KernelOptions& o) { o.cpu_grouped_gemm = engine; });
      std::vector<std::vector<float>> Cs = C0;
      std::vector<float*> C(count);
      std::vector<const void*> A(count), B(count);
      for (int64_t i = 0; i < count; ++i) C[i] = Cs[i].data(), A[i] = As[i].data(), B[i] = Bs[i].data();
      be->gemm_grouped(gemm_problems(C.data(), A.data(), B.data(), DType::kBF16, Ms.data(), Ns.data(), Ks.data(), count, kind.ta, kind.tb), kind.ta, kind.tb, 1.0f, kind.beta);
      return Cs;
    };
    const auto amx = run("amx"), onednn = run("onednn");
    for (int64_t i = 0; i < count; ++i)
      for (size_t j = 0; j < amx[i].size(); ++j)
        ASSERT_NEAR(amx[i][j], onednn[i][j], 1e-5 * (1 + std::fabs(onednn[i][j]))) << i << " " << j;
  }
  KernelOptions bad = native_lowp();
  bad.cpu_grouped_gemm = "tiles";
  EXPECT_THROW(be->set_options(bad), std::invalid_argument);
}

// The backend's typed bf16 GEMM split over its threads on the AMX unit (B packed by column
// blocks per thread, rows by 32-row pairs per thread) against oneDNN: row counts that split
// unevenly, N and K off the tiles' multiples, B transposed or not, beta 0 and 1; A transposed
// stays on oneDNN (the same bits either way); a bad engine name refused.
TEST(Amx, DenseGemmMatchesOneDnn) {
  if (!amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  auto be = make_cpu_backend(2);
  be->set_options(native_lowp());
  if (!be->low_precision_gemm_native(DType::kBF16)) GTEST_SKIP() << "no native bf16 matmul";
  std::mt19937 rng(14);
  std::normal_distribution<float> d(0.f, 1.f);
  struct Case {
    int64_t M, N, K;
    bool ta, tb;
    float beta;
  };
  for (const Case c : {Case{100, 45, 70, false, true, 0.0f}, Case{96, 64, 96, false, false, 1.0f},
                       Case{33, 200, 40, false, true, 1.0f}, Case{64, 48, 50, true, false, 1.0f}}) {
    SCOPED_TRACE(::testing::Message() << c.M << " x " << c.N << " x " << c.K << (c.ta ? " A^T" : "")
                                      << (c.tb ? " B^T" : "") << " beta " << c.beta);
    std::vector<uint16_t> A(size_t(c.M * c.K)), B(size_t(c.K * c.N));
    for (auto& v : A) v = to_bf16(d(rng));
    for (auto& v : B) v = to_bf16(d(rng));
    std::vector<float> C0(size_t(c.M * c.N));
    for (auto& v : C0) v = d(rng);
    const auto run = [&](const char* engine) {
      const WithOptions use(*be, [&](KernelOptions& o) { o.cpu_dense_gemm = engine; });
      std::vector<float> C = C0;
      be->gemm({C.data(), {c.M, c.N}},
               {ConstView{A.data(), DType::kBF16},
                c.ta ? dstrain::kernels::Dims{c.K, c.M} : dstrain::kernels::Dims{c.M, c.K}},
               {ConstView{B.data(), DType::kBF16},
                c.tb ? dstrain::kernels::Dims{c.N, c.K} : dstrain::kernels::Dims{c.K, c.N}},
               c.ta, c.tb, 1.0f, c.beta);
      return C;
    };
    const auto amx = run("amx"), onednn = run("onednn");
    for (size_t i = 0; i < amx.size(); ++i)
      ASSERT_NEAR(amx[i], onednn[i], 1e-5 * (1 + std::fabs(onednn[i]))) << i;
    if (c.ta) {
      EXPECT_EQ(amx, onednn);
    }
  }
  KernelOptions bad = native_lowp();
  bad.cpu_dense_gemm = "tiles";
  EXPECT_THROW(be->set_options(bad), std::invalid_argument);
}

// The AMX path and the oneDNN tiles compute the same thing from the same bf16 values with fp32
// accumulation and round P and dS alike: they agree to fp32 rounding, and the forward pass
// exactly where the products sum in the same order.
TEST(Amx, AttentionMatchesTheOneDnnTiles) {
  if (!amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  auto be = make_cpu_backend(2);
  be->set_options(native_lowp());
  {
    const WithOptions onednn(*be, [](KernelOptions& o) { o.cpu_attention = "onednn"; });
    if (!be->low_precision_attention(DType::kBF16)) GTEST_SKIP() << "no oneDNN bf16 matmul on this CPU";
  }
  const int64_t B = 1, S = 333, nh = 2, dqk = 72, dv = 40, N = B * S;
  be->reserve_attention(S);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.f, 1.f);
  const auto randn16 = [&](int64_t n) {
    std::vector<uint16_t> h(static_cast<size_t>(n));
    for (auto& v : h) v = to_bf16(2.0f * d(rng));
    return h;
  };
  const auto q16 = randn16(N * nh * dqk), k16 = randn16(N * nh * dqk), v16 = randn16(N * nh * dv),
             do16 = randn16(N * nh * dv);
  std::vector<float> dO(do16.size());
  for (size_t i = 0; i < dO.size(); ++i) dO[i] = from_bf16(do16[i]);
  const ConstView q{q16.data(), DType::kBF16}, k{k16.data(), DType::kBF16}, v{v16.data(), DType::kBF16};
  struct Out {
    std::vector<float> O, lse, dQ, dK, dV;
  };
  const auto run = [&](const char* tiles) {
    const WithOptions choice(*be, [&](KernelOptions& o) { o.cpu_attention = tiles; });
    Out o{std::vector<float>(size_t(N * nh * dv)), std::vector<float>(size_t(N * nh)),
          std::vector<float>(q16.size()), std::vector<float>(k16.size()), std::vector<float>(v16.size())};
    be->attention_forward({o.O.data(), {B, S, nh, dv}}, {o.lse.data(), {B, nh, S}}, {q, {B, S, nh, dqk}},
                          {k, {B, S, nh, dqk}}, {v, {B, S, nh, dv}}, 0.125f);
    be->attention_backward({o.dQ.data(), {B, S, nh, dqk}}, {o.dK.data(), {B, S, nh, dqk}},
                           {o.dV.data(), {B, S, nh, dv}}, {dO.data(), {B, S, nh, dv}},
                           {do16.data(), DType::kBF16, {B, S, nh, dv}}, {q, {B, S, nh, dqk}}, {k, {B, S, nh, dqk}},
                           {v, {B, S, nh, dv}}, {o.O.data(), {B, S, nh, dv}}, {o.lse.data(), {B, nh, S}}, 0.125f);
    return o;
  };
  const Out a = run("amx"), r = run("onednn");
  const auto close = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    double scale = 0;
    for (float w : want) scale = std::max(scale, double(std::fabs(w)));
    ASSERT_GT(scale, 0.0) << what;
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-6 * scale) << what << " " << i;
  };
  close(a.O, r.O, "O");
  close(a.lse, r.lse, "lse");
  close(a.dQ, r.dQ, "dQ");
  close(a.dK, r.dK, "dK");
  close(a.dV, r.dV, "dV");
  // A value the selector does not know is refused by name.
  KernelOptions bad = native_lowp();
  bad.cpu_attention = "flash";
  try {
    be->set_options(bad);
    ADD_FAILURE() << "kernels.cpu_attention flash accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("kernel option flash: valid for the CPU's products: auto, amx, onednn"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dstrain::kernels::cpu
