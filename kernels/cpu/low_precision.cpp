#include "kernels/cpu/low_precision.h"

#include <cpuid.h>

#include <dnnl.h>
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dnnl.hpp>
#include <map>
#include <optional>
#include <stdexcept>

#include "kernels/cpu/amx.h"

namespace dstrain::kernels::cpu {

const char* to_string(LowPrecision p) { return p == LowPrecision::kBf16 ? "bf16" : "fp16"; }

void convert_to(uint16_t* out, const float* in, int64_t n, LowPrecision p) {
  int64_t i = 0;
  if (p == LowPrecision::kBf16) {
#if defined(__AVX512BF16__)
    // vcvtneps2bf16 treats subnormal inputs as zero: a block holding one goes the scalar way.
    const __m512 tiny = _mm512_set1_ps(1.17549435e-38f), magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (; i + 16 <= n; i += 16) {
      const __m512 x = _mm512_loadu_ps(in + i), a = _mm512_and_ps(x, magnitude);
      if (_mm512_cmp_ps_mask(a, tiny, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_OQ)) {
        for (int64_t j = i; j < i + 16; ++j) out[j] = to_bf16(in[j]);
        continue;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(x));
    }
#endif
    // Without AVX512-BF16 the compiler vectorises this loop (to_bf16 is integer arithmetic and a
    // select): an explicit AVX2 version measured no faster on Zen 3 (2026-12-03, bench lowp).
    for (; i < n; ++i) out[i] = to_bf16(in[i]);
    return;
  }
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) out[i] = to_fp16(in[i]);
}

void convert_from(float* out, const uint16_t* in, int64_t n, LowPrecision p) {
  int64_t i = 0;
  if (p == LowPrecision::kBf16) {
    for (; i < n; ++i) out[i] = from_bf16(in[i]);  // a shift: the compiler vectorises it
    return;
  }
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#endif
  for (; i < n; ++i) out[i] = from_fp16(in[i]);
}

namespace {
struct LowPrecisionGemmEntry {
  std::optional<dnnl::matmul> prim;  // empty: oneDNN has none for this type here (the fallback runs)
  dnnl::memory::desc a, b, c;
  std::string impl;
  bool varying = false;  // run-time dimensions: the memory descriptors are made per call
};

// alpha as an output scale, beta as a sum post-op.
dnnl::primitive_attr gemm_attributes(float alpha, float beta) {
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  return attr;
}
}  // namespace

struct LowPrecisionGemm::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  using Entry = LowPrecisionGemmEntry;
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, float, float>;
  std::map<Key, Entry> cache;
  mutable std::mutex mu;  // the cache
  std::mutex run_mu;      // the stream and `wide`
  std::vector<float> wide;  // the fallback's fp32 copies of A and B
  std::mutex choice_mu;
  std::optional<bool> native_[2];
  std::string forced;  // "native", "widened", or "" for the CPU's rule (under choice_mu)
  const std::string& override_choice() { return forced; }
  // The 768^3 shape the choice between native and widened is measured on.
  Entry& probe(LowPrecision p) { return entry(768, 768, 768, false, true, p, 1.0f, 0.0f, false); }
  double speedup_[2] = {0, 0};

  Entry& entry(int64_t M, int64_t N, int64_t K, bool ta, bool tb, LowPrecision p, float alpha, float beta,
               bool varying) {
    if (varying) M = N = K = DNNL_RUNTIME_DIM_VAL;
    const Key key{M, N, K, ta, tb, int(p), alpha, beta};
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    using dt = dnnl::memory::data_type;
    const dt in = p == LowPrecision::kBf16 ? dt::bf16 : dt::f16;
    Entry e;
    e.varying = varying;
    // Logical A [M,K], B [K,N], C [M,N]; a transposed operand is the stored matrix read by columns.
    e.a = dnnl::memory::desc({M, K}, in, ta ? dnnl::memory::dims{1, M} : dnnl::memory::dims{K, 1});
    e.b = dnnl::memory::desc({K, N}, in, tb ? dnnl::memory::dims{1, K} : dnnl::memory::dims{N, 1});
    e.c = dnnl::memory::desc({M, N}, dt::f32, dnnl::memory::dims{N, 1});
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(e.a, e.b, e.c), gemm_attributes(alpha, beta), engine);
      e.impl = pd.impl_info_str();
      e.prim.emplace(pd);
    } catch (const dnnl::error&) {
      e.impl = std::string(to_string(p)) + " widened to fp32, sgemm (oneDNN has no " + to_string(p) +
               " matmul for this CPU)";
    }
    return cache.emplace(key, std::move(e)).first->second;
  }
};

LowPrecisionGemm::LowPrecisionGemm(const std::string& choice) : impl_(std::make_unique<Impl>()) { set_choice(choice); }

void LowPrecisionGemm::set_choice(const std::string& choice) {
  if (choice != "auto" && choice != "native" && choice != "widened")
    throw std::invalid_argument("kernels.lowp_gemm " + choice + ": valid: auto, native, widened");
  std::lock_guard<std::mutex> lock(impl_->choice_mu);
  impl_->forced = choice == "auto" ? "" : choice;
  impl_->native_[0].reset(), impl_->native_[1].reset();
}
LowPrecisionGemm::~LowPrecisionGemm() = default;

namespace {
void run_native(dnnl::engine& engine, dnnl::stream& stream, const LowPrecisionGemmEntry& e, float* C, const uint16_t* A,
                const uint16_t* B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, LowPrecision p) {
  using dt = dnnl::memory::data_type;
  const dt in = p == LowPrecision::kBf16 ? dt::bf16 : dt::f16;
  const auto desc = [&](const dnnl::memory::desc& fixed, int64_t r, int64_t c, bool t, dt type) {
    return e.varying ? dnnl::memory::desc({r, c}, type, t ? dnnl::memory::dims{1, r} : dnnl::memory::dims{c, 1})
                     : fixed;
  };
  dnnl::memory a(desc(e.a, M, K, ta, in), engine, const_cast<uint16_t*>(A)),
      b(desc(e.b, K, N, tb, in), engine, const_cast<uint16_t*>(B)), c(desc(e.c, M, N, false, dt::f32), engine, C);
  e.prim->execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
  stream.wait();
}

void run_widened(std::vector<float>& w, float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N,
                 int64_t K, bool ta, bool tb, float alpha, float beta, LowPrecision p) {
  w.resize(size_t(M * K + K * N));
  convert_from(w.data(), A, M * K, p);
  convert_from(w.data() + M * K, B, K * N, p);
  const dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, w.data(), ta ? M : K,
                                      w.data() + M * K, tb ? K : N, beta, C, N);
  if (st != dnnl_success) throw std::runtime_error("dnnl_sgemm failed");
}
}  // namespace

void LowPrecisionGemm::run(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N, int64_t K,
                           bool ta, bool tb, float alpha, float beta, LowPrecision p, bool varying) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M * N; ++i) C[i] = beta == 0.0f ? 0.0f : beta * C[i];
    return;
  }
  Impl::Entry& e = impl_->entry(M, N, K, ta, tb, p, alpha, beta, varying);
  const bool use_native = e.prim && native(p);
  std::lock_guard<std::mutex> lock(impl_->run_mu);  // one stream and one widening buffer: calls are serialised
  if (use_native) return run_native(impl_->engine, impl_->stream, e, C, A, B, M, N, K, ta, tb, p);
  run_widened(impl_->wide, C, A, B, M, N, K, ta, tb, alpha, beta, p);
}

void LowPrecisionGemm::run_on_this_thread(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N,
                                          int64_t K, bool ta, bool tb, float alpha, float beta, LowPrecision p) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M * N; ++i) C[i] = beta == 0.0f ? 0.0f : beta * C[i];
    return;
  }
  struct ThreadState {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    std::map<Impl::Key, LowPrecisionGemmEntry> cache;
  };
  thread_local ThreadState ts;
  const auto R = DNNL_RUNTIME_DIM_VAL;
  const Impl::Key key{R, R, R, ta, tb, int(p), alpha, beta};
  auto it = ts.cache.find(key);
  if (it == ts.cache.end()) {
    const LowPrecisionGemmEntry& shared = impl_->entry(M, N, K, ta, tb, p, alpha, beta, true);
    if (!shared.prim) throw std::logic_error("LowPrecisionGemm::run_on_this_thread without a native matmul");
    LowPrecisionGemmEntry e = shared;  // the descriptors; the primitive made again on this thread
    e.prim.emplace(dnnl::matmul::primitive_desc(dnnl::matmul::desc(e.a, e.b, e.c), gemm_attributes(alpha, beta),
                                                ts.engine));
    it = ts.cache.emplace(key, std::move(e)).first;
  }
  run_native(ts.engine, ts.stream, it->second, C, A, B, M, N, K, ta, tb, p);
}

std::string LowPrecisionGemm::implementation(int64_t M, int64_t N, int64_t K, bool ta, bool tb, LowPrecision p,
                                             bool varying) {
  const Impl::Entry& e = impl_->entry(M, N, K, ta, tb, p, 1.0f, 0.0f, varying);
  if (!e.prim && operands_16bit(p))
    return std::string(to_string(p)) + " on 16-bit operands, each GEMM widening them to fp32 for sgemm (kernels.lowp_gemm native; oneDNN has no " +
           to_string(p) + " matmul for this CPU)";
  if (!e.prim || native(p)) return e.impl;
  const double s = native_speedup(p);
  char ratio[32] = "";
  if (s > 0) std::snprintf(ratio, sizeof ratio, " measured %.2fx as fast", s);
  return std::string(to_string(p)) + " widened to fp32, sgemm (native " + e.impl + ratio + ")";
}

bool LowPrecisionGemm::operands_16bit(LowPrecision p) {
  if (native(p)) return true;
  std::lock_guard<std::mutex> lock(impl_->choice_mu);
  return impl_->override_choice() == "native";
}

namespace {
// Whether this CPU's 16-bit matmuls beat fp32 ones, from its instruction sets alone, so that the
// choice — and with it every GEMM's numerics — never depends on how busy the machine is when it
// is made (a timed choice flipped under load: bf16 tiny's gradients differed from run to run on
// a loaded 2-core Sapphire Rapids). The rule is the measurements': bf16 on the AMX unit (2.2-3.4x
// fp32 on Sapphire Rapids), and AVX512-BF16 on AMD's cores (1.8x on Zen 4, whose fp32 FMAs are
// 256 bits wide), not on Intel's without AMX (0.5-0.7x: two 512-bit fp32 FMA units); fp16 on the
// AMX unit's fp16 products only (oneDNN 2.6 had no fp16 matmul on any CPU measured).
bool faster_in_16_bits(LowPrecision p) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) a = 0;
  const bool avx512_bf16 = (a >> 5) & 1u, amx_fp16 = (a >> 21) & 1u;
  unsigned vendor[4] = {0, 0, 0, 0};
  __get_cpuid(0, &vendor[3], &vendor[0], &vendor[2], &vendor[1]);  // (EBX, EDX, ECX spell it)
  const bool amd = std::memcmp(vendor, "AuthenticAMD", 12) == 0;
  if (p == LowPrecision::kBf16) return cpu::amx_bf16_usable() || (avx512_bf16 && amd);
  return amx_fp16 && cpu::amx_bf16_usable();  // (the tile state granted: AMX-FP16 needs it too)
}
}  // namespace

bool LowPrecisionGemm::native(LowPrecision p) {
  std::lock_guard<std::mutex> lock(impl_->choice_mu);
  std::optional<bool>& choice = impl_->native_[int(p)];
  if (choice) return *choice;
  const Impl::Entry& e = impl_->probe(p);
  const std::string& forced = impl_->override_choice();
  if (!e.prim) return *(choice = false);
  if (!forced.empty()) return *(choice = forced == "native");
  return *(choice = faster_in_16_bits(p));
}

double LowPrecisionGemm::native_speedup(LowPrecision p) {
  if (!has_native_matmul(p)) return 0;
  {
    std::lock_guard<std::mutex> lock(impl_->choice_mu);
    if (impl_->speedup_[int(p)] > 0) return impl_->speedup_[int(p)];
  }
  // Measured for the report only (the choice is native()'s rule): a 768^3 GEMM both ways.
  constexpr int64_t n = 768;
  const Impl::Entry& e = impl_->probe(p);
  std::vector<uint16_t> a(size_t(n * n)), b(size_t(n * n));
  std::vector<float> c(size_t(n * n));
  for (size_t i = 0; i < a.size(); ++i) {
    const float x = float(int(i % 7) - 3), y = float(int(i % 5) - 2);
    a[i] = p == LowPrecision::kBf16 ? to_bf16(x) : to_fp16(x);
    b[i] = p == LowPrecision::kBf16 ? to_bf16(y) : to_fp16(y);
  }
  std::lock_guard<std::mutex> run_lock(impl_->run_mu);
  const auto best = [&](bool nat) {
    double t = 1e30;
    for (int rep = 0; rep < 5; ++rep) {  // the first is a warm-up
      const auto t0 = std::chrono::steady_clock::now();
      if (nat) run_native(impl_->engine, impl_->stream, e, c.data(), a.data(), b.data(), n, n, n, false, true, p);
      else run_widened(impl_->wide, c.data(), a.data(), b.data(), n, n, n, false, true, 1.0f, 0.0f, p);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (rep > 0) t = std::min(t, s);
    }
    return t;
  };
  const double t_native = best(true), t_wide = best(false);
  std::lock_guard<std::mutex> lock(impl_->choice_mu);
  return impl_->speedup_[int(p)] = t_wide / t_native;
}

bool LowPrecisionGemm::has_native_matmul(LowPrecision p) {
  return impl_->probe(p).prim.has_value();
}

int64_t LowPrecisionGemm::cached_shapes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return int64_t(impl_->cache.size());
}

std::string onednn_isa() {
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return "other";
  }
}

}  // namespace dstrain::kernels::cpu
