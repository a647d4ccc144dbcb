// Causal attention on 16-bit Q, K, V (docs/design.md §6.8): the same tiling as the fp32 kernel
// of cpu_ops.h — per (sequence, head) query tiles of kAttnTile rows, a tile's scores against the
// keys it may see, masked softmax in place, then P V — with every GEMM on 16-bit operands and
// fp32 accumulation: the scores and their gradient are formed in fp32, softmax, log-sum-exp and
// the row sums D = rowsum(dO * O) stay fp32, and the probabilities P and the score gradients dS
// are rounded to the 16-bit type just before the GEMMs that read them (as flash attention does
// on GPUs). One task per (sequence, head) on the OpenMP threads; the tile GEMMs run inside it
// through oneDNN matmul primitives made per tile shape (oneDNN runs them on the calling thread).
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/cpu/low_precision.h"

namespace dstrain::kernels::cpu {

// C[M,N] (row stride ldc, fp32) = op(A) op(B) (+ C when accumulate) for 16-bit A and B with row
// strides lda, ldb (A is [M,K] or, when ta, [K,M]; B is [K,N] or, when tb, [N,K]). Callable from
// several threads at once.
class TileGemm {
 public:
  explicit TileGemm(LowPrecision p);
  ~TileGemm();
  // Whether oneDNN has a native matmul for this type on this CPU (bf16 on AVX512-BF16 and AMX;
  // fp16 only on AVX512-FP16 / AMX-FP16).
  bool available() const;
  void run(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t M,
           int64_t N, int64_t K, bool ta, bool tb, bool accumulate) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Per-thread dense copies of one (sequence, head)'s operands: oneDNN's AMX matmul runs on dense
// operands only (strided ones fall back to its older gemm:jit kernels, 3-5x slower here), so each
// task gathers its head's Q, K, V (and dO) into these first and scatters its outputs after.
struct AttentionPack {
  int64_t u16 = 0;  // 16-bit elements: Q, K [S, dqk], V, dO [S, dv]
  int64_t f32 = 0;  // fp32 elements: dK [S, dqk], dV [S, dv] and one output tile
};
AttentionPack attention_pack_elems(int64_t S, int64_t dqk, int64_t dv, int threads);

// Scratch: the fp32 workspace of the fp32 kernel (attention_workspace_floats), per thread two
// kAttnTile x S blocks of 16-bit values (attention_workspace_floats(S, threads) uint16_t), and
// the packs (attention_pack_elems(S, dqk, dv, threads)).
void attention_forward_lp(float* O, float* lse, const uint16_t* Q, const uint16_t* K, const uint16_t* V, int64_t B,
                          int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, float* ws, uint16_t* ws16,
                          uint16_t* pack16, float* pack32, int ws_threads, const TileGemm& gemm, LowPrecision p);
// dO (fp32) gives the row sums D with O; dO16 is the same gradient in the 16-bit type for the GEMMs.
void attention_backward_lp(float* dQ, float* dK, float* dV, const float* dO, const uint16_t* dO16, const uint16_t* Q,
                           const uint16_t* K, const uint16_t* V, const float* O, const float* lse, int64_t B, int64_t S,
                           int64_t nh, int64_t dqk, int64_t dv, float scale, float* ws, uint16_t* ws16,
                           uint16_t* pack16, float* pack32, int ws_threads, const TileGemm& gemm, LowPrecision p);

// The same attention with its GEMMs on the AMX unit (bf16 only; where amx_bf16_usable()):
// per (sequence, head) each B operand is packed once into the tile unit's layout (kernels/cpu/
// amx.h) and every operand is padded with zeros to whole tiles (S to a multiple of
// kAttnTile, the head widths to multiples of 32), so the tile products have no edges. The
// softmax and its gradient are the functions the oneDNN path runs, row by row, so P and dS are
// rounded exactly as there. Scratch per thread: attention_amx_elems.
AttentionPack attention_amx_elems(int64_t S, int64_t dqk, int64_t dv, int threads);
void attention_forward_amx(float* O, float* lse, const uint16_t* Q, const uint16_t* K, const uint16_t* V, int64_t B,
                           int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, uint16_t* pack16,
                           float* pack32, int ws_threads);
void attention_backward_amx(float* dQ, float* dK, float* dV, const float* dO, const uint16_t* dO16, const uint16_t* Q,
                            const uint16_t* K, const uint16_t* V, const float* O, const float* lse, int64_t B,
                            int64_t S, int64_t nh, int64_t dqk, int64_t dv, float scale, uint16_t* pack16,
                            float* pack32, int ws_threads);

}  // namespace dstrain::kernels::cpu
