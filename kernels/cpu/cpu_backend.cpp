// The CPU backend: BLAS (OpenBLAS, OpenMP build, or oneDNN) for GEMMs, the templated kernels of
// cpu_ops.h instantiated for float, OpenMP threads owned by the backend.
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/op_times.h"
#include "kernels/cpu/amx.h"
#include "kernels/cpu/attention_lp.h"
#include "kernels/cpu/blas_gemm.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/low_precision.h"

extern "C" void openblas_set_num_threads(int);

namespace dstrain::kernels {

const char* to_string(GemmLibrary lib) {
  return lib == GemmLibrary::kOneDnn ? "oneDNN" : "OpenBLAS";
}

namespace {

cpu::LowPrecision low(DType t) {
  if (t == DType::kF32) throw std::invalid_argument("fp32 is not a low-precision type");
  return t == DType::kBF16 ? cpu::LowPrecision::kBf16 : cpu::LowPrecision::kFp16;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, GemmLibrary gemm) : gemm_(gemm) {
    threads_ = threads > 0 ? threads : omp_get_max_threads();
    omp_set_num_threads(threads_);
    openblas_set_num_threads(threads_);
    name_ = std::string("cpu (") + to_string(gemm_) + ", " + std::to_string(threads_) + " threads)";
    num_threads_ = threads_;
    op_timing_clock_ = "the host clock";
  }

  void check_attention(int64_t S) const {
    if (S > attention_s_)
      throw std::invalid_argument("attention on " + std::to_string(S) + " positions, but the backend reserved " +
                                  std::to_string(attention_s_) + " (call reserve_attention)");
  }

  void set_op_timing_impl(bool on) override { times_.set(on); }
  std::vector<OpTime> take_op_times_impl() override { return times_.take(); }

  void* allocate(int64_t bytes) override {
    const size_t n = size_t((std::max<int64_t>(bytes, 1) + 63) / 64 * 64);
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* p) override { std::free(p); }
  void copy_impl(void* dst, const void* src, int64_t bytes, CopyKind kind) override {
    const HostOpTimes::Scope op_scope(times_, kind == CopyKind::kToHost     ? "copy_to_host"
                                              : kind == CopyKind::kFromHost ? "copy_from_host"
                                                                            : "copy");
    std::memcpy(dst, src, size_t(bytes));
  }
  int64_t device_memory_free_impl() override { return -1; }
  void synchronize_impl() override {}  // every op has finished when it returns
  void sum_squares_impl(double* out, const float* x, int64_t n, bool accumulate) override {
    const HostOpTimes::Scope op_scope(times_, "sum_squares");
    double sum = 0;
#pragma omp parallel for simd reduction(+ : sum) schedule(static)
    for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
    *out = accumulate ? *out + sum : sum;
  }

  void convert_impl(View dst, ConstView src, int64_t n) override {
    const HostOpTimes::Scope op_scope(times_, "convert");
    if (dst.dtype == src.dtype) {
      std::memcpy(dst.data, src.data, size_t(n * dtype_size(src.dtype)));
      return;
    }
    // Blocks of 4096 elements (a multiple of every vector width) over the threads.
    constexpr int64_t kBlock = 4096;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = b * kBlock, m = std::min(kBlock, n - i);
      if (dst.dtype == DType::kF32)
        cpu::convert_from(static_cast<float*>(dst.data) + i, static_cast<const uint16_t*>(src.data) + i, m,
                          low(src.dtype));
      else
        cpu::convert_to(static_cast<uint16_t*>(dst.data) + i, static_cast<const float*>(src.data) + i, m,
                        low(dst.dtype));
    }
  }

  void gemm_impl(float* C, ConstView A, ConstView B, int64_t M, int64_t N, int64_t K, bool ta, bool tb, float alpha,
                 float beta) override {
    const HostOpTimes::Scope op_scope(times_, "gemm");
    if (A.dtype == DType::kF32)
      return gemm_f32(C, static_cast<const float*>(A.data), static_cast<const float*>(B.data), M, N, K, ta, tb, alpha,
                  beta);
    // bf16 on the AMX unit where there is one (unless DSTRAIN_DENSE_GEMM=onednn), A not
    // transposed (the weight gradients stay on oneDNN, as the experts' do).
    if (!ta && M >= 32 && (beta == 0.0f || beta == 1.0f) && alpha == 1.0f && lowp_.native(low(A.dtype)) &&
        own_amx(A.dtype, options_.cpu_dense_gemm))
      return amx_dense(C, static_cast<const uint16_t*>(A.data), static_cast<const uint16_t*>(B.data), M, N, K, tb,
                       beta == 1.0f);
    lowp_.run(C, static_cast<const uint16_t*>(A.data), static_cast<const uint16_t*>(B.data), M, N, K, ta, tb, alpha,
              beta, low(A.dtype));
  }
  // One product over the threads: B packed once (its column blocks split over the threads),
  // then each thread's rows (whole 32-row tile pairs) against it.
  void amx_dense(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N, int64_t K, bool tb,
                 bool accumulate) {
    const int64_t Np = (N + 15) / 16 * 16;
    const int64_t packed = cpu::amx_packed_b_elems(N, K) + 32;  // + line_aligned's slack
    if (int64_t(amx_b_.size()) < packed) amx_b_.resize(size_t(packed));
    amx_ws_.resize(size_t(threads_));
    uint16_t* Bv = cpu::line_aligned(amx_b_.data());
#pragma omp parallel num_threads(threads_)
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t blocks = Np / 16;
      cpu::amx_pack_b(Bv, B, N, K, tb, blocks * t / T * 16, blocks * (t + 1) / T * 16);
#pragma omp barrier
      const int64_t pairs = (M + 31) / 32, m0 = std::min(M, pairs * t / T * 32), m1 = std::min(M, pairs * (t + 1) / T * 32);
      if (m1 > m0) {
        AmxScratch& w = amx_ws_[size_t(t)].grow(m1 - m0, N, K);
        cpu::amx_matmul_packed(C + m0 * N, A + m0 * K, Bv, m1 - m0, N, K, accumulate, w.u16.data(), w.f32.data());
      }
    }
  }
  void gemm_grouped_impl(float* const* C, const void* const* A, const void* const* B, DType dtype,
                         const int64_t* M, const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb,
                         float alpha, float beta) override {
    const HostOpTimes::Scope op_scope(times_, "gemm_grouped");
    if (dtype == DType::kF32)
      return gemm_grouped_f32(C, reinterpret_cast<const float* const*>(A), reinterpret_cast<const float* const*>(B), M,
                          N, K, count, ta, tb, alpha, beta);
    // The row counts change every step: run-time dimensions, one primitive for all of them.
    // Many problems: one per thread at a time, as the fp32 form (small GEMMs run closer to the
    // core's rate on one thread each than one after the other on all threads).
    if (count >= 2 * threads_ && lowp_.native(low(dtype))) {
      // bf16 on the AMX unit where there is one (unless DSTRAIN_GROUPED_GEMM=onednn): oneDNN 2.6
      // has no AMX kernel for run-time shapes (its gemm:jit runs them at AVX512-BF16's rate).
      // The weight gradients (A transposed) too, through a transposing copy of A.
      if ((beta == 0.0f || beta == 1.0f) && alpha == 1.0f && own_amx(dtype, options_.cpu_grouped_gemm)) {
        amx_ws_.resize(size_t(threads_));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_)
        for (int64_t i = 0; i < count; ++i) {
          AmxScratch& w = amx_ws_[size_t(omp_get_thread_num())].grow(M[i], N[i], K[i], ta);
          cpu::amx_matmul(C[i], static_cast<const uint16_t*>(A[i]), static_cast<const uint16_t*>(B[i]), M[i], N[i],
                          K[i], ta, tb, beta == 1.0f, w.u16.data(), w.f32.data());
        }
        return;
      }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads_)
      for (int64_t i = 0; i < count; ++i)
        lowp_.run_on_this_thread(C[i], static_cast<const uint16_t*>(A[i]), static_cast<const uint16_t*>(B[i]), M[i],
                                 N[i], K[i], ta, tb, alpha, beta, low(dtype));
      return;
    }
    for (int64_t i = 0; i < count; ++i)
      lowp_.run(C[i], static_cast<const uint16_t*>(A[i]), static_cast<const uint16_t*>(B[i]), M[i], N[i], K[i], ta,
                tb, alpha, beta, low(dtype), true);
  }
  // 16-bit attention only where the 16-bit GEMMs run natively: where they are widened the
  // model's dO comes in fp32 (ComputeCast), and Q, K, V are widened to match.
  LowPrecisionSupport low_precision_impl(DType dtype, bool describe) override {
    LowPrecisionSupport s;
    if (describe)
      s.gemm_implementation = dtype == DType::kF32 ? to_string(gemm_)
                                                   : lowp_.implementation(256, 256, 256, false, true, low(dtype)) +
                                                         " (isa " + cpu::onednn_isa() + ")";
    if (dtype == DType::kF32) return s;
    s.gemm_native = lowp_.operands_16bit(low(dtype));
    s.attention = lowp_.native(low(dtype)) && (amx_attention(dtype) || tile_gemm(dtype).available());
    return s;
  }

  // fp32 (the typed ops' fp32 case).
  void gemm_f32(float* C, const float* A, const float* B, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                float alpha, float beta) {
    if (M == 0 || N == 0) return;
    if (K == 0) {  // BLAS leaves C untouched for K = 0; C = beta * C is what the math says
      for (int64_t i = 0; i < M * N; ++i) C[i] = beta == 0.0f ? 0.0f : beta * C[i];
      return;
    }
    if (gemm_ == GemmLibrary::kOneDnn) {
      const dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A,
                                          ta ? M : K, B, tb ? K : N, beta, C, N);
      if (st != dnnl_success) throw std::runtime_error("dnnl_sgemm failed");
      return;
    }
    cpu::blas_gemm(C, A, B, M, N, K, ta, tb, alpha, beta);
  }

  void gemm_grouped_f32(float* const* C, const float* const* A, const float* const* B, const int64_t* M,
                        const int64_t* N, const int64_t* K, int64_t count, bool ta, bool tb, float alpha, float beta) {
    // Many small problems: one per thread at a time (the BLAS runs single-threaded inside an
    // OpenMP region), largest first. Few problems: one after the other, each with all threads.
    if (count < 2 * threads_) {
      for (int64_t i = 0; i < count; ++i) gemm_f32(C[i], A[i], B[i], M[i], N[i], K[i], ta, tb, alpha, beta);
      return;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) gemm_f32(C[i], A[i], B[i], M[i], N[i], K[i], ta, tb, alpha, beta);
  }

  void rmsnorm_forward_impl(View y, float* rstd, const float* x, const float* w, int64_t rows, int64_t C,
                            float eps) override {
    const HostOpTimes::Scope op_scope(times_, "rmsnorm_forward");
    if (y.dtype == DType::kF32) return cpu::rmsnorm_forward(static_cast<float*>(y.data), rstd, x, w, rows, C, eps);
    rows_rounded(y, rows, C, [&](int64_t r, float* row) { cpu::rmsnorm_row(row, rstd + r, x + r * C, w, C, eps); });
  }
  void rmsnorm_backward_impl(float* dx, float* dw, const float* dy, const float* x, const float* w,
                             const float* rstd, int64_t rows, int64_t C) override {
    const HostOpTimes::Scope op_scope(times_, "rmsnorm_backward");
    cpu::rmsnorm_backward(dx, dw, dy, x, w, rstd, rows, C);
  }
  void rope_forward_impl(View out, int64_t out_ts, int64_t out_hs, const float* in, int64_t in_ts, int64_t in_hs,
                         const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                         bool interleave) override {
    const HostOpTimes::Scope op_scope(times_, "rope_forward");
    if (out.dtype == DType::kF32)
      return cpu::rope_forward(static_cast<float*>(out.data), out_ts, out_hs, in, in_ts, in_hs, cos, sin, N, S, heads,
                               dr, interleave);
    const int64_t half = dr / 2;
    vectors_rounded(out, N, heads, dr, out_ts, out_hs, [&](int64_t t, int64_t h, float* v) {
      cpu::rope_forward_row(v, in + t * in_ts + h * in_hs, cos + (t % S) * half, sin + (t % S) * half, half,
                            interleave);
    });
  }
  void rope_backward_impl(View din, int64_t in_ts, int64_t in_hs, const float* dout, int64_t out_ts, int64_t out_hs,
                          const float* cos, const float* sin, int64_t N, int64_t S, int64_t heads, int64_t dr,
                          bool interleave, bool accumulate) override {
    const HostOpTimes::Scope op_scope(times_, "rope_backward");
    if (din.dtype == DType::kF32)
      return cpu::rope_backward(static_cast<float*>(din.data), in_ts, in_hs, dout, out_ts, out_hs, cos, sin, N, S,
                                heads, dr, interleave, accumulate);
    const int64_t half = dr / 2;
    vectors_rounded(din, N, heads, dr, in_ts, in_hs, [&](int64_t t, int64_t h, float* v) {
      cpu::rope_backward_row(v, dout + t * out_ts + h * out_hs, cos + (t % S) * half, sin + (t % S) * half, half,
                             interleave, false);
    });
  }
  void reserve_attention_impl(int64_t S) override {
    const int64_t n = cpu::attention_workspace_floats(S, threads_);
    if (int64_t(attention_ws_.size()) < n) attention_ws_.assign(size_t(n), 0.0f);
    if (int64_t(attention_ws16_.size()) < n) attention_ws16_.assign(size_t(n), 0);
    attention_s_ = std::max(attention_s_, S);
  }
  const cpu::TileGemm& tile_gemm(DType t) const { return t == DType::kBF16 ? tile_bf16_ : tile_fp16_; }
  // bf16 attention on the AMX unit where there is one (kernels/cpu/amx.h), unless
  // kernels.cpu_attention is onednn; else its tile GEMMs are oneDNN matmuls. Either way 16-bit
  // attention only where the 16-bit GEMMs run natively: where they are widened the model's dO
  // comes in fp32 (ComputeCast), and Q, K, V are widened to match.
  bool amx_attention(DType t) const { return own_amx(t, options_.cpu_attention); }
  // bf16 on this file's AMX tile products where the CPU has them, unless the option (one of
  // KernelOptions' cpu_* fields, checked by set_options) says onednn.
  static bool own_amx(DType t, const std::string& choice) {
    return t == DType::kBF16 && choice != "onednn" && cpu::amx_bf16_usable();
  }
  void set_options_impl(const KernelOptions& o) override {
    for (const std::string* v : {&o.cpu_dense_gemm, &o.cpu_grouped_gemm, &o.cpu_attention})
      if (*v != "auto" && *v != "amx" && *v != "onednn")
        throw std::invalid_argument("kernel option " + *v + ": valid for the CPU's products: auto, amx, onednn");
    lowp_.set_choice(o.lowp_gemm);
  }
  void attention_forward_impl(float* O, float* lse, ConstView Q, ConstView K, ConstView V, int64_t B, int64_t S,
                              int64_t nh, int64_t dqk, int64_t dv, float scale) override {
    const HostOpTimes::Scope op_scope(times_, "attention_forward");
    if (Q.dtype == DType::kF32)
      return attention_forward_f32(O, lse, static_cast<const float*>(Q.data), static_cast<const float*>(K.data),
                               static_cast<const float*>(V.data), B, S, nh, dqk, dv, scale);
    check_lowp_attention(Q.dtype);
    check_attention(S);
    reserve_packs(S, dqk, dv);
    if (amx_attention(Q.dtype))
      return cpu::attention_forward_amx(O, lse, static_cast<const uint16_t*>(Q.data),
                                        static_cast<const uint16_t*>(K.data), static_cast<const uint16_t*>(V.data), B,
                                        S, nh, dqk, dv, scale, attention_pack16_.data(), attention_pack32_.data(),
                                        threads_);
    cpu::attention_forward_lp(O, lse, static_cast<const uint16_t*>(Q.data), static_cast<const uint16_t*>(K.data),
                              static_cast<const uint16_t*>(V.data), B, S, nh, dqk, dv, scale, attention_ws_.data(),
                              attention_ws16_.data(), attention_pack16_.data(), attention_pack32_.data(), threads_,
                              tile_gemm(Q.dtype), low(Q.dtype));
  }
  void attention_backward_impl(float* dQ, float* dK, float* dV, const float* dO, ConstView dO_lp, ConstView Q,
                               ConstView K, ConstView V, const float* O, const float* lse, int64_t B, int64_t S,
                               int64_t nh, int64_t dqk, int64_t dv, float scale) override {
    const HostOpTimes::Scope op_scope(times_, "attention_backward");
    if (Q.dtype == DType::kF32)
      return attention_backward_f32(dQ, dK, dV, dO, static_cast<const float*>(Q.data), static_cast<const float*>(K.data),
                                static_cast<const float*>(V.data), O, lse, B, S, nh, dqk, dv, scale);
    check_lowp_attention(Q.dtype);
    check_attention(S);
    reserve_packs(S, dqk, dv);
    if (amx_attention(Q.dtype))
      return cpu::attention_backward_amx(dQ, dK, dV, dO, static_cast<const uint16_t*>(dO_lp.data),
                                         static_cast<const uint16_t*>(Q.data), static_cast<const uint16_t*>(K.data),
                                         static_cast<const uint16_t*>(V.data), O, lse, B, S, nh, dqk, dv, scale,
                                         attention_pack16_.data(), attention_pack32_.data(), threads_);
    cpu::attention_backward_lp(dQ, dK, dV, dO, static_cast<const uint16_t*>(dO_lp.data),
                               static_cast<const uint16_t*>(Q.data), static_cast<const uint16_t*>(K.data),
                               static_cast<const uint16_t*>(V.data), O, lse, B, S, nh, dqk, dv, scale,
                               attention_ws_.data(), attention_ws16_.data(), attention_pack16_.data(),
                               attention_pack32_.data(), threads_, tile_gemm(Q.dtype), low(Q.dtype));
  }
  // The 16-bit kernels' dense per-head copies: sized by the head widths, which reserve_attention
  // does not know, so they grow on the first call with a model's widths (once per model).
  void reserve_packs(int64_t S, int64_t dqk, int64_t dv) {
    const cpu::AttentionPack n = cpu::attention_pack_elems(S, dqk, dv, threads_),
                             a = cpu::attention_amx_elems(S, dqk, dv, threads_);
    const int64_t u16 = std::max(n.u16, a.u16), f32 = std::max(n.f32, a.f32);
    if (int64_t(attention_pack16_.size()) < u16) attention_pack16_.resize(size_t(u16));
    if (int64_t(attention_pack32_.size()) < f32) attention_pack32_.resize(size_t(f32));
  }
  // (Backend::attention_forward has checked that the views are of one type.)
  void check_lowp_attention(DType t) {
    if (!low_precision_impl(t, false).attention)
      throw std::invalid_argument(std::string("no ") + to_string(t) + " attention on this CPU (oneDNN has no " +
                                  to_string(t) + " matmul for it): pass fp32 views");
  }
  void attention_forward_f32(float* O, float* lse, const float* Q, const float* K, const float* V, int64_t B,
                             int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale) {
    check_attention(S);
    cpu::attention_forward(O, lse, Q, K, V, B, S, nh, dqk, dv, scale, attention_ws_.data(), threads_);
  }
  void attention_backward_f32(float* dQ, float* dK, float* dV, const float* dO, const float* Q, const float* K,
                              const float* V, const float* O, const float* lse, int64_t B, int64_t S, int64_t nh,
                              int64_t dqk, int64_t dv, float scale) {
    check_attention(S);
    cpu::attention_backward(dQ, dK, dV, dO, Q, K, V, O, lse, B, S, nh, dqk, dv, scale, attention_ws_.data(),
                            threads_);
  }
  void swiglu_forward_impl(View M, const float* GU, int64_t N, int64_t I) override {
    const HostOpTimes::Scope op_scope(times_, "swiglu_forward");
    if (M.dtype == DType::kF32) return cpu::swiglu_forward(static_cast<float*>(M.data), GU, N, I);
    rows_rounded(M, N, I, [&](int64_t t, float* row) { cpu::swiglu_row(row, GU + t * 2 * I, I); });
  }
  void swiglu_backward_impl(View dGU, const float* dM, const float* GU, int64_t N, int64_t I) override {
    const HostOpTimes::Scope op_scope(times_, "swiglu_backward");
    if (dGU.dtype == DType::kF32) return cpu::swiglu_backward(static_cast<float*>(dGU.data), dM, GU, N, I);
    rows_rounded(dGU, N, 2 * I,
                 [&](int64_t t, float* row) { cpu::swiglu_backward_row(row, dM + t * I, GU + t * 2 * I, I); });
  }
  void router_forward_impl(int32_t* idx, float* w, float* scores, const float* logits, const float* bias,
                           int64_t N, const RouterParams& p) override {
    const HostOpTimes::Scope op_scope(times_, "router_forward");
    if (p.num_experts > 1024) throw std::invalid_argument("router: more than 1024 experts");
    cpu::router_forward(idx, w, scores, logits, bias, N, p);
  }
  void router_backward_impl(float* dlogits, const float* dw, const float* dscores_extra, const float* scores,
                            const int32_t* idx, int64_t N, const RouterParams& p) override {
    const HostOpTimes::Scope op_scope(times_, "router_backward");
    cpu::router_backward(dlogits, dw, dscores_extra, scores, idx, N, p);
  }
  void moe_plan_impl(int32_t* pos, int32_t* src, int32_t* counts, const int32_t* idx, int64_t N, int64_t k,
                     int64_t E) override {
    const HostOpTimes::Scope op_scope(times_, "moe_plan");
    std::fill(counts, counts + E, 0);
    for (int64_t i = 0; i < N * k; ++i) {
      if (idx[i] < 0 || idx[i] >= E)
        throw std::invalid_argument("moe_plan: expert " + std::to_string(idx[i]) + " of " + std::to_string(E));
      ++counts[idx[i]];
    }
    std::vector<int64_t> cursor(size_t(E), 0);
    for (int64_t e = 1; e < E; ++e) cursor[size_t(e)] = cursor[size_t(e - 1)] + counts[e - 1];
    for (int64_t t = 0; t < N; ++t)  // a counting sort, stable in (token, slot)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = cursor[size_t(idx[t * k + j])]++;
        pos[t * k + j] = int32_t(row);
        src[row] = int32_t(t);
      }
  }
  static int64_t balance_group(const BalanceShape& b, int64_t i) {
    const int64_t g = b.group_len > 0 ? (b.first + i) / b.group_len : 0;
    if (g < 0 || g >= b.groups)
      throw std::invalid_argument("balance loss: token " + std::to_string(b.first + i) + " falls in group " +
                                  std::to_string(g) + " of " + std::to_string(b.groups));
    return g;
  }
  void moe_balance_stats_impl(float* stats, const int32_t* idx, const float* scores, const BalanceShape& b) override {
    const HostOpTimes::Scope op_scope(times_, "moe_balance_stats");
    std::vector<double> acc(size_t(2 * b.groups * b.E), 0.0);
    double* f = acc.data();
    double* P = f + b.groups * b.E;
    for (int64_t i = 0; i < b.n; ++i) {
      const int64_t g = balance_group(b, i);
      for (int64_t j = 0; j < b.k; ++j) f[g * b.E + idx[i * b.k + j]] += double(b.E) / double(b.k * b.T);
      const float* s = scores + i * b.E;
      double sum = 0;
      for (int64_t e = 0; e < b.E; ++e) sum += s[e];
      for (int64_t e = 0; e < b.E; ++e) P[g * b.E + e] += s[e] / sum / double(b.T);
    }
    for (size_t i = 0; i < acc.size(); ++i) stats[i] = float(acc[i]);
  }
  void moe_balance_grad_impl(float* dscores, float* aux, const float* stats, const float* scores,
                             const BalanceShape& b, double weight, double grad_scale) override {
    const HostOpTimes::Scope op_scope(times_, "moe_balance_grad");
    const float* f = stats;
    const float* P = stats + b.groups * b.E;
    if (aux) {
      double total = 0;
      for (int64_t g = 0; g < b.groups; ++g) {
        double loss = 0;
        for (int64_t e = 0; e < b.E; ++e) loss += double(f[g * b.E + e]) * double(P[g * b.E + e]);
        total += weight * loss;
      }
      aux[0] = float(double(aux[0]) + total);
    }
    // dL/ds'_{t,e} = weight f_e / T, then through s' = s / sum(s).
    for (int64_t i = 0; i < b.n; ++i) {
      const float* fg = f + balance_group(b, i) * b.E;
      const float* s = scores + i * b.E;
      double sum = 0, dot = 0;
      for (int64_t e = 0; e < b.E; ++e) sum += s[e];
      for (int64_t e = 0; e < b.E; ++e) dot += weight * fg[e] / double(b.T) * s[e] / sum;
      for (int64_t e = 0; e < b.E; ++e)
        dscores[i * b.E + e] = float((weight * fg[e] / double(b.T) - dot) / sum * grad_scale);
    }
  }
  void gather_rows_impl(View out, const float* in, const int32_t* src, int64_t n, int64_t H) override {
    const HostOpTimes::Scope op_scope(times_, "gather_rows");
    if (out.dtype == DType::kF32) return cpu::gather_rows(static_cast<float*>(out.data), in, src, n, H);
    const cpu::LowPrecision lp = low(out.dtype);
    uint16_t* o = static_cast<uint16_t*>(out.data);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) cpu::convert_to(o + i * H, in + int64_t(src[i]) * H, H, lp);
  }
  void moe_combine_impl(float* out, const float* Y, const float* w, const int32_t* pos, int64_t N, int64_t k,
                        int64_t H) override {
    if (!w) {  // moe_dispatch_backward
      const HostOpTimes::Scope op_scope(times_, "moe_dispatch_backward");
      return cpu::moe_dispatch_backward(out, Y, pos, N, k, H);
    }
    const HostOpTimes::Scope op_scope(times_, "moe_combine");
    cpu::moe_combine(out, Y, w, pos, N, k, H);
  }
  void moe_combine_backward_impl(View dY, float* dw, const float* dout, const float* Y, const float* w,
                                 const int32_t* pos, int64_t N, int64_t k, int64_t H) override {
    const HostOpTimes::Scope op_scope(times_, "moe_combine_backward");
    if (dY.dtype == DType::kF32)
      return cpu::moe_combine_backward(static_cast<float*>(dY.data), dw, dout, Y, w, pos, N, k, H);
    const cpu::LowPrecision lp = low(dY.dtype);
    uint16_t* o = static_cast<uint16_t*>(dY.data);
#pragma omp parallel
    {
      std::vector<float> row(size_t(std::max<int64_t>(H, 0)));
#pragma omp for schedule(static)
      for (int64_t t = 0; t < N; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = pos[t * k + j];
          dw[t * k + j] = cpu::moe_combine_backward_row(row.data(), dout + t * H, Y + r * H, w[t * k + j], H);
          cpu::convert_to(o + r * H, row.data(), H, lp);
        }
    }
  }
  void cross_entropy_impl(float* loss, float* logits, const int32_t* target, int64_t rows, int64_t V,
                          float grad_scale) override {
    const HostOpTimes::Scope op_scope(times_, "cross_entropy");
    cpu::cross_entropy(loss, logits, target, rows, V, grad_scale);
  }
  void cross_entropy_row_max_impl(float* row_max, const float* logits, int64_t rows, int64_t V) override {
    const HostOpTimes::Scope op_scope(times_, "cross_entropy_row_max");
    cpu::cross_entropy_row_max(row_max, logits, rows, V);
  }
  void cross_entropy_row_sums_impl(float* sums, const float* logits, const float* row_max, const int32_t* target,
                                   int64_t v0, int64_t rows, int64_t V) override {
    const HostOpTimes::Scope op_scope(times_, "cross_entropy_row_sums");
    cpu::cross_entropy_row_sums(sums, logits, row_max, target, v0, rows, V);
  }
  void cross_entropy_finish_impl(float* loss, float* logits, const float* row_max, const float* sums,
                                 const int32_t* target, int64_t v0, int64_t rows, int64_t V,
                                 float grad_scale) override {
    const HostOpTimes::Scope op_scope(times_, "cross_entropy_finish");
    cpu::cross_entropy_finish(loss, logits, row_max, sums, target, v0, rows, V, grad_scale);
  }
  void embedding_forward_impl(float* out, ConstView table, const int32_t* ids, int64_t N, int64_t H) override {
    const HostOpTimes::Scope op_scope(times_, "embedding_forward");
    if (table.dtype == DType::kF32) return cpu::embedding_forward(out, static_cast<const float*>(table.data), ids, N, H);
    const auto* t16 = static_cast<const uint16_t*>(table.data);
    const cpu::LowPrecision p = low(table.dtype);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; ++t) {  // rows widened exactly (a negative id: a zero row)
      float* o = out + t * H;
      if (ids[t] < 0) std::fill(o, o + H, 0.0f);
      else cpu::convert_from(o, t16 + int64_t(ids[t]) * H, H, p);
    }
  }
  void embedding_backward_impl(float* dtable, const float* dout, const int32_t* ids, int64_t N, int64_t H,
                               int64_t V) override {
    const HostOpTimes::Scope op_scope(times_, "embedding_backward");
    cpu::embedding_backward(dtable, dout, ids, N, H, V);
  }
  // adamw_round in one pass: each block of 4096 elements is updated, rounded and widened while it
  // is in cache (the unfused three read and write the master weights and the copies three times).
  void adamw_impl(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p, View half,
                  float* widened) override {
    if (!half.data) {
      const HostOpTimes::Scope op_scope(times_, "adamw");
      return cpu::adamw(param, grad, m, v, n, p);
    }
    const HostOpTimes::Scope op_scope(times_, "adamw_round");
    const cpu::AdamWStep<float> s(p);
    const cpu::LowPrecision lp = low(half.dtype);
    uint16_t* h = static_cast<uint16_t*>(half.data);
    constexpr int64_t kBlock = 4096;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = b * kBlock, len = std::min(kBlock, n - i);
      s.run(param + i, grad + i, m + i, v + i, len);
      cpu::convert_to(h + i, param + i, len, lp);
      if (widened) cpu::convert_from(widened + i, h + i, len, lp);
    }
  }
  void add_impl(float* y, const float* x, int64_t n) override {
    const HostOpTimes::Scope op_scope(times_, "add");
    cpu::add(y, x, n);
  }
  void fill_impl(float* y, float value, int64_t n) override {
    const HostOpTimes::Scope op_scope(times_, "fill");
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) y[i] = value;
  }
  void copy_strided_impl(View dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t cols) override {
    const HostOpTimes::Scope op_scope(times_, "copy_strided");
    if (dst.dtype == DType::kF32) return cpu::copy_strided(static_cast<float*>(dst.data), ds, src, ss, rows, cols);
    const cpu::LowPrecision lp = low(dst.dtype);
    uint16_t* o = static_cast<uint16_t*>(dst.data);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) cpu::convert_to(o + r * ds, src + r * ss, cols, lp);
  }
  void add_strided_impl(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows,
                        int64_t cols) override {
    const HostOpTimes::Scope op_scope(times_, "add_strided");
    cpu::add_strided(dst, ds, src, ss, rows, cols);
  }

 private:
  // rows x width values into a 16-bit `out`: fill(r, row) makes row r in fp32 (the fp32 op's own
  // code, row by row) in a per-thread row, which is then rounded — the bits of the fp32 op and
  // convert(), while the fp32 array a separate pass would write and read again stays in L1 / L2.
  template <class Fill>
  static void rows_rounded(View out, int64_t rows, int64_t width, Fill&& fill) {
    const cpu::LowPrecision lp = low(out.dtype);
    uint16_t* o = static_cast<uint16_t*>(out.data);
#pragma omp parallel
    {
      std::vector<float> row(size_t(std::max<int64_t>(width, 0)));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        fill(r, row.data());
        cpu::convert_to(o + r * width, row.data(), width, lp);
      }
    }
  }

  // The same for rows x per_row vectors of `width` values at out + r * rs + i * is (element
  // strides): fill(r, i, v) makes vector (r, i) in fp32 in a per-thread buffer, then rounded.
  template <class Fill>
  static void vectors_rounded(View out, int64_t rows, int64_t per_row, int64_t width, int64_t rs, int64_t is,
                              Fill&& fill) {
    const cpu::LowPrecision lp = low(out.dtype);
    uint16_t* o = static_cast<uint16_t*>(out.data);
#pragma omp parallel
    {
      std::vector<float> v(size_t(std::max<int64_t>(width, 0)));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < per_row; ++i) {
          fill(r, i, v.data());
          cpu::convert_to(o + r * rs + i * is, v.data(), width, lp);
        }
    }
  }

  int threads_ = 1;
  HostOpTimes times_;  // monitor.op_breakdown
  GemmLibrary gemm_;
  mutable cpu::LowPrecisionGemm lowp_;  // (const queries may measure which path is faster, once)
  std::vector<float> attention_ws_;  // per-thread score blocks (reserve_attention)
  std::vector<uint16_t> attention_ws16_;  // and their 16-bit roundings (low-precision attention)
  std::vector<uint16_t> attention_pack16_;  // dense per-head operands (low-precision attention)
  std::vector<float> attention_pack32_;
  std::vector<uint16_t> amx_b_;  // a dense AMX product's packed B
  struct AmxScratch {  // one thread's: an AMX product's packed operands and row buffer
    std::vector<uint16_t> u16;
    std::vector<float> f32;
    AmxScratch& grow(int64_t M, int64_t N, int64_t K, bool ta = false) {  // to amx_matmul_workspace
      const cpu::AmxMatmulWorkspace need = cpu::amx_matmul_workspace(M, N, K, ta);
      if (int64_t(u16.size()) < need.u16) u16.resize(size_t(need.u16));
      if (int64_t(f32.size()) < need.f32) f32.resize(size_t(need.f32));
      return *this;
    }
  };
  std::vector<AmxScratch> amx_ws_;  // per thread
  cpu::TileGemm tile_bf16_{cpu::LowPrecision::kBf16}, tile_fp16_{cpu::LowPrecision::kFp16};
  int64_t attention_s_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads, GemmLibrary gemm) {
  return std::make_unique<CpuBackend>(num_threads, gemm);
}

}  // namespace dstrain::kernels
