// Low-precision building blocks of the CPU backend (docs/design.md §6.8): bf16 and fp16 storage
// with round-to-nearest-even conversion, and GEMMs on bf16 / fp16 inputs accumulating in fp32
// through oneDNN's matmul (AMX or AVX512-BF16 where the CPU has them; oneDNN picks at run time).
// The mixed-precision training path builds on these; they are usable and tested on their own.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "dstrain/kernels/half.h"

namespace dstrain::kernels::cpu {

enum class LowPrecision : uint8_t { kBf16, kFp16 };
const char* to_string(LowPrecision p);

// The scalar conversions (round to nearest even; dstrain/kernels/half.h).
using kernels::from_bf16;
using kernels::from_fp16;
using kernels::to_bf16;
using kernels::to_fp16;
// Arrays, with the vector instructions of the build where it has them (AVX512-BF16, F16C).
void convert_to(uint16_t* out, const float* in, int64_t n, LowPrecision p);
void convert_from(float* out, const uint16_t* in, int64_t n, LowPrecision p);

// C[M,N] (fp32) = alpha op(A) op(B) + beta C with A, B in `p`, products accumulated in fp32.
// Row-major like Backend::gemm: A is [M,K] (or [K,M] when trans_a), B [K,N] (or [N,K] when
// trans_b). One oneDNN matmul primitive per shape, built on first use and cached. Where oneDNN
// has no fp16 matmul for this CPU (it needs AVX512-FP16 or AMX-FP16), fp16 inputs are widened
// to fp32 and multiplied by sgemm — the same products, exactly representable. Calls from several
// threads are serialised (each GEMM uses the backend's threads itself). Shapes that change from
// call to call (the experts' row counts) pass `varying`: one primitive per type, transposes,
// alpha and beta with run-time dimensions, instead of one per shape.
class LowPrecisionGemm {
 public:
  // `choice`: kernels.lowp_gemm (KernelOptions::lowp_gemm) — auto, native or widened; anything
  // else is std::invalid_argument. set_choice changes it (and forgets the decisions made).
  explicit LowPrecisionGemm(const std::string& choice = "auto");
  ~LowPrecisionGemm();
  void set_choice(const std::string& choice);
  void run(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N, int64_t K, bool trans_a,
           bool trans_b, float alpha, float beta, LowPrecision p, bool varying = false);
  // The same with run-time dimensions on the calling thread alone, for several GEMMs at once from
  // inside an OpenMP region (a grouped GEMM's problems, one per thread): the primitive and stream
  // are the thread's own (oneDNN's library scratchpad wants a primitive run on the thread that
  // made it), and oneDNN runs single-threaded inside the region. Native only: call it where
  // native(p) holds.
  void run_on_this_thread(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N, int64_t K,
                          bool trans_a, bool trans_b, float alpha, float beta, LowPrecision p);
  // The implementation oneDNN chose for this shape (e.g. "brg:avx512_core_amx"), or how the
  // fallback computes it.
  std::string implementation(int64_t M, int64_t N, int64_t K, bool trans_a, bool trans_b, LowPrecision p,
                             bool varying = false);
  int64_t cached_shapes() const;
  // Whether run() uses oneDNN's native 16-bit matmul for `p` (else it widens the inputs to fp32
  // and runs sgemm: the same products, exactly representable, accumulated in fp32). Decided
  // once per type from the CPU's instruction sets, never by timing (a timed choice flipped when
  // the machine was busy, and the run's numerics with it): native where oneDNN has the matmul
  // and the CPU has bf16 on the AMX unit, or AVX512-BF16 on an AMD core — the measurements:
  // AVX512-BF16 without AMX ran 1.85x fp32's rate on Zen 4 but 0.5-0.7x of it on an Intel Xeon
  // with two 512-bit FMA units; fp16 only with AMX-FP16. The choice native | widened overrides
  // the rule (native only where oneDNN has the matmul).
  bool native(LowPrecision p);
  // Whether callers should hand this type's GEMMs 16-bit operands: where native(p) holds, and
  // also where the choice native asks for them on a CPU whose oneDNN has no matmul for
  // `p` — run() then widens the operands inside every call (the same products; slower than
  // passing fp32 copies, but it runs the callers' 16-bit-operand paths on any CPU: fp16 on
  // every CPU seen here, bf16 on AVX2-only ones).
  bool operands_16bit(LowPrecision p);
  // widened time / native time of a 768^3 GEMM both ways (best of four, ~30 ms, measured on the
  // first call; for reports only — native() does not use it); 0 without a native matmul.
  double native_speedup(LowPrecision p);
  // Whether oneDNN has a 16-bit matmul for `p` on this CPU at all (AVX2-only CPUs have none for
  // either type): where it has none, run() always widens and native(p) is false.
  bool has_native_matmul(LowPrecision p);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The most capable instruction set oneDNN dispatches to on this CPU ("avx512_core_bf16", ...).
std::string onednn_isa();

}  // namespace dstrain::kernels::cpu
