// AMX-BF16 tile products for the 16-bit attention (docs/design.md §6.8): the attention's GEMMs
// are many small products (a 64-row query tile against the keys it sees), where oneDNN's matmul
// repacks its B operand on every call and spends as long in set-up as in the product. Here the B
// operands are packed once per (sequence, head) into the layout the AMX unit reads, and each
// product is a plain loop of tile loads and tile dot products on the calling thread.
//
// This file's functions run only where amx_bf16_usable() said yes; their translation unit is
// compiled for AMX and AVX-512 BW whatever the machine the build ran on.
#pragma once

#include <cstdint>

namespace dstrain::kernels::cpu {

// A tile row is 64 bytes: tiles whose rows start on cache lines are read and written a line per
// row, others two (the AMX products run at about half the rate on misaligned operands). The
// workspaces below hold 64 bytes of slack for this.
template <class T>
T* line_aligned(T* p) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// The CPU has AMX-TILE and AMX-BF16 (and AVX-512 BW), and Linux let this process use the tile
// registers (arch_prctl ARCH_REQ_XCOMP_PERM). Asked once per process.
bool amx_bf16_usable();

// The "VNNI" layout of a product's B operand, B [K, N] (bf16): column blocks of 16, each block
// K/2 rows of 64 bytes holding (B(k, n), B(k+1, n)) for its 16 columns n, k even; the block of
// columns [16 j, 16 j + 16) starts at element j * block_stride (>= 16 K).
//
// Packs B(k, n) = src[k * ld + n] (transposed: src[n * ld + k]) for k < K, n < N, with zeros up
// to Kp x Np (Kp even, Np a multiple of 16).
void vnni_pack(uint16_t* Bv, int64_t block_stride, const uint16_t* src, int64_t ld, int64_t K, int64_t N,
               int64_t Kp, int64_t Np, bool transposed);

// C [M, N] (fp32, row stride ldc) = A B (+ C when accumulate): A [M, K] bf16 with row stride
// lda, B in the VNNI layout above; M and N multiples of 16, K a multiple of 32. Accumulates in
// fp32 (the tile unit's bf16 dot products).
void amx_gemm(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t block_stride,
              int64_t M, int64_t N, int64_t K, bool accumulate);

// A whole GEMM on one thread, for the experts' grouped GEMMs (CpuBackend::gemm_grouped, docs/
// design.md §6.8): C [M, N] (row stride N) = op(A) op(B) (+ C when accumulate), bf16 operands
// in BLAS's row-major conventions — op(A) = A [M, K], or A^T of A [K, M] when ta; op(B) = B
// [K, N], or B^T of B [N, K] when tb — for any M, N, K >= 0. B is packed into the VNNI layout;
// A is read in place where K is a multiple of 32, else copied padded (A^T: transposed into the
// workspace with K padded); rows past the last whole tile go through a padded tile.
struct AmxMatmulWorkspace {
  int64_t u16 = 0, f32 = 0;  // elements
};
AmxMatmulWorkspace amx_matmul_workspace(int64_t M, int64_t N, int64_t K, bool ta = false);
void amx_matmul(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                bool accumulate, uint16_t* ws16, float* ws32);
// amx_matmul in its two parts, for one product split over threads (CpuBackend::gemm): the
// column blocks [n_begin, n_end) of packed B (n_begin a multiple of 16, n_end at most N rounded
// up to 16; Bv holds them all, amx_packed_b_elems), then rows of A against the packed B (ws16:
// amx_matmul_workspace(M, N, K).u16 - amx_packed_b_elems(N, K) elements, ws32 its f32).
int64_t amx_packed_b_elems(int64_t N, int64_t K);
void amx_pack_b(uint16_t* Bv, const uint16_t* B, int64_t N, int64_t K, bool tb, int64_t n_begin, int64_t n_end);
void amx_matmul_packed(float* C, const uint16_t* A, const uint16_t* Bv, int64_t M, int64_t N, int64_t K,
                       bool accumulate, uint16_t* ws16, float* ws32);

}  // namespace dstrain::kernels::cpu
