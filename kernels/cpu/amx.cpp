#include "kernels/cpu/amx.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace dstrain::kernels::cpu {

bool amx_bf16_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool avx512bw = (b >> 30) & 1u, amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    if (!avx512bw || !amx_bf16 || !amx_tile) return false;
    // Linux hands out the tile state (XTILEDATA, feature 18) only on request.
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return usable;
}

// Everything below runs only after amx_bf16_usable(): each function is compiled for AMX and
// AVX-512 BW by its own target attribute (GCC and clang alike), and none calls a
// standard-library template, so none of the program's shared inline code is built for them.
#define DSTRAIN_AMX __attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")))
// GCC 12 takes the undefined upper half of _mm512_castsi256_si512, and the undefined pass-through
// operand of the AVX-512 interleaves, for uninitialised reads.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

// Palette 1, the eight tiles all 16 rows of 64 bytes: 0-3 hold C, 4-5 A, 6-7 B.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

DSTRAIN_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

// One block of MT x NT tiles of 16 x 16 (MT, NT in {1, 2}): rows of A from A, columns of B from
// Bv (its first column block; the second at + block_stride), over K in steps of 32.
template <int MT, int NT>
DSTRAIN_AMX void tile_block(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t block_stride,
                int64_t K, bool accumulate) {
  const int64_t sc = ldc * 4, sa = lda * 2;
  float* C1 = C + 16 * ldc;
  if (accumulate) {
    _tile_loadd(0, C, sc);
    if constexpr (NT == 2) _tile_loadd(1, C + 16, sc);
    if constexpr (MT == 2) _tile_loadd(2, C1, sc);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, C1 + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
  const uint16_t* B1 = Bv + block_stride;
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(4, A + k, sa);
    if constexpr (MT == 2) _tile_loadd(5, A + 16 * lda + k, sa);
    _tile_loadd(6, Bv + k * 16, 64);  // rows k/2 .. k/2 + 15 of the block, 32 elements each
    if constexpr (NT == 2) _tile_loadd(7, B1 + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2 && NT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, sc);
  if constexpr (NT == 2) _tile_stored(1, C + 16, sc);
  if constexpr (MT == 2) _tile_stored(2, C1, sc);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, C1 + 16, sc);
}

template <int MT>
DSTRAIN_AMX void tile_row(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t block_stride,
              int64_t N, int64_t K, bool accumulate) {
  int64_t n = 0;
  for (; n + 32 <= N; n += 32)
    tile_block<MT, 2>(C + n, ldc, A, lda, Bv + (n / 16) * block_stride, block_stride, K, accumulate);
  if (n < N) tile_block<MT, 1>(C + n, ldc, A, lda, Bv + (n / 16) * block_stride, block_stride, K, accumulate);
}

// The word order that interleaves two rows of 16 held in one register: (r0[0], r1[0], r0[1],
// r1[1], ...) from (r0[0..15], r1[0..15]).
alignas(64) constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// r[j][i] = r[i][j] for a 16 x 16 matrix of 32-bit words held as 16 rows: 32-bit and 64-bit
// interleaves within the 128-bit lanes, then two rounds of lane shuffles.
DSTRAIN_AMX void transpose_16x16_words(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);      // per lane: a0 b0 a1 b1
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  //           a2 b2 a3 b3
  }
  for (int g = 0; g < 4; ++g) {  // rows 4g .. 4g + 3: u[4g + c] holds their column 4l + c in lane l
    const __m512i* q = t + 4 * g;
    u[4 * g + 0] = _mm512_unpacklo_epi64(q[0], q[2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(q[0], q[2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(q[1], q[3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(q[1], q[3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i y = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v, x, 0x88);       // column c (lane 0 of each)
    r[4 + c] = _mm512_shuffle_i32x4(w, y, 0x88);   // column 4 + c
    r[8 + c] = _mm512_shuffle_i32x4(v, x, 0xdd);   // column 8 + c
    r[12 + c] = _mm512_shuffle_i32x4(w, y, 0xdd);  // column 12 + c
  }
}

// dst [cols, ldd] = the transpose of src [rows, cols] (row stride lds), its columns padded with
// zeros to rows_pad (a multiple of 32, at most ldd): 32 x 16 blocks, each two source rows
// interleaved into 16 words (a word is then one destination row's two elements) and the 16 x 16
// words transposed.
DSTRAIN_AMX void transpose_padded(uint16_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows,
                                  int64_t cols, int64_t rows_pad) {
  const __m512i order = _mm512_load_si512(kInterleave);
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const int64_t width = cols - c0 < 16 ? cols - c0 : 16;
    const __mmask16 mask = __mmask16((1u << width) - 1u);
    for (int64_t r0 = 0; r0 < rows_pad; r0 += 32) {
      __m512i w[16];
      for (int p = 0; p < 16; ++p) {
        const int64_t r = r0 + 2 * p;
        const __m256i a = r < rows ? _mm256_maskz_loadu_epi16(mask, src + r * lds + c0) : _mm256_setzero_si256();
        const __m256i b =
            r + 1 < rows ? _mm256_maskz_loadu_epi16(mask, src + (r + 1) * lds + c0) : _mm256_setzero_si256();
        w[p] = _mm512_permutexvar_epi16(order, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
      }
      transpose_16x16_words(w);
      for (int64_t j = 0; j < width; ++j) _mm512_storeu_si512(dst + (c0 + j) * ldd + r0, w[j]);
    }
  }
}

}  // namespace

DSTRAIN_AMX void vnni_pack(uint16_t* Bv, int64_t block_stride, const uint16_t* src, int64_t ld, int64_t K, int64_t N,
               int64_t Kp, int64_t Np, bool transposed) {
  const __m512i order = _mm512_load_si512(kInterleave);
  // Transposed with an even row stride: a pair (k, k + 1) of row n is one 32-bit word, so a
  // 64-byte row of the layout is 16 such words gathered from 16 rows.
  const bool words = transposed && ld % 2 == 0;
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(int(ld / 2)));
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    uint16_t* block = Bv + (n0 / 16) * block_stride;
    int64_t k = 0;
    // Transposed, 16 whole rows: 32 values of each, as 16 words, transposed into 16 rows of the
    // layout at once (the gather below moves one word per element loaded).
    if (words && n0 + 16 <= N)
      for (; k + 32 <= K; k += 32) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (n0 + i) * ld + k);
        transpose_16x16_words(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(block + (k + 2 * j) * 16, r[j]);
      }
    for (; k < Kp; k += 2) {
      uint16_t* out = block + k * 16;
      if (!transposed && k + 1 < K && n0 + 16 <= N) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k * ld + n0));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (k + 1) * ld + n0));
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
        _mm512_storeu_si512(out, _mm512_permutexvar_epi16(order, both));
        continue;
      }
      if (words && k + 1 < K && n0 + 16 <= N) {
        _mm512_storeu_si512(out, _mm512_i32gather_epi32(rows16, src + n0 * ld + k, 4));
        continue;
      }
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t n = n0 + j;
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t kk = k + e;
          out[2 * j + e] = kk < K && n < N ? (transposed ? src[n * ld + kk] : src[kk * ld + n]) : uint16_t(0);
        }
      }
    }
  }
}

// Over K in chunks of kKc when K is long: C is then stored and loaded again between chunks (the
// same fp32 sums in the same order), but B's chunk (kKc x N: 1.2 MiB for N = 768) stays in the
// core's 2 MiB L2 cache while every row strip of A meets it, where all of B (2.4 MiB at K =
// 1536) came from L3 for each strip: 1.3-1.5x on the weight gradients' K of 1536 tokens and on
// K = 3072 and 8192 (64-byte aligned operands, one thread, Sapphire Rapids).
DSTRAIN_AMX void amx_gemm(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t block_stride,
              int64_t M, int64_t N, int64_t K, bool accumulate) {
  configure_tiles();
  constexpr int64_t kKc = 768, kLongK = 1024;
  const int64_t chunk = K > kLongK ? kKc : K > 0 ? K : 1;  // K = 0: one pass that zeroes or keeps C
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += chunk) {
    const int64_t kn = K - k0 < chunk ? K - k0 : chunk;
    const bool acc = accumulate || k0 > 0;
    const uint16_t* B = Bv + k0 * 16;  // rows k0 / 2 .. of each column block
    int64_t m = 0;
    for (; m + 32 <= M; m += 32) tile_row<2>(C + m * ldc, ldc, A + m * lda + k0, lda, B, block_stride, N, kn, acc);
    if (m < M) tile_row<1>(C + m * ldc, ldc, A + m * lda + k0, lda, B, block_stride, N, kn, acc);
  }
  _tile_release();
}

namespace {

// dst [rows_pad, ld_dst] = src [rows, cols] (row stride ld_src) with zeros to the right and below.
DSTRAIN_AMX void copy_padded(uint16_t* dst, int64_t ld_dst, const uint16_t* src, int64_t ld_src, int64_t rows,
                             int64_t cols, int64_t rows_pad) {
  for (int64_t r = 0; r < rows_pad; ++r) {
    uint16_t* d = dst + r * ld_dst;
    int64_t c = 0;
    if (r < rows)
      for (; c < cols; ++c) d[c] = src[r * ld_src + c];
    for (; c < ld_dst; ++c) d[c] = 0;
  }
}

// Rows [0, rows) of C [., N] (row stride ldc) into a tile row's buffer T [16, Np] (zeros
// elsewhere; all zeros unless `load`), and back.
DSTRAIN_AMX void rows_in(float* T, int64_t Np, const float* C, int64_t ldc, int64_t rows, int64_t N, bool load) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t n = 0; n < Np; ++n) T[r * Np + n] = load && r < rows && n < N ? C[r * ldc + n] : 0.0f;
}
DSTRAIN_AMX void rows_out(float* C, int64_t ldc, const float* T, int64_t Np, int64_t rows, int64_t N) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < N; ++n) C[r * ldc + n] = T[r * Np + n];
}

}  // namespace

AmxMatmulWorkspace amx_matmul_workspace(int64_t M, int64_t N, int64_t K, bool ta) {
  const int64_t Kp = (K + 31) / 32 * 32, Np = (N + 15) / 16 * 16, Mp = (M + 15) / 16 * 16;
  return {Kp * Np + Mp * Kp + (ta ? M * Kp : 0) + 32, 16 * Np + 16};  // + line_aligned's slack
}

int64_t amx_packed_b_elems(int64_t N, int64_t K) { return (K + 31) / 32 * 32 * ((N + 15) / 16 * 16); }

DSTRAIN_AMX void amx_pack_b(uint16_t* Bv, const uint16_t* B, int64_t N, int64_t K, bool tb, int64_t n_begin,
                            int64_t n_end) {
  if (K <= 0 || n_end <= n_begin) return;
  const int64_t Kp = (K + 31) / 32 * 32, cols = (n_end < N ? n_end : N) - n_begin;
  vnni_pack(Bv + (n_begin / 16) * Kp * 16, Kp * 16, tb ? B + n_begin * K : B + n_begin, tb ? K : N, K,
            cols > 0 ? cols : 0, Kp, n_end - n_begin, tb);
}

DSTRAIN_AMX void amx_matmul(float* C, const uint16_t* A, const uint16_t* B, int64_t M, int64_t N, int64_t K, bool ta,
                            bool tb, bool accumulate, uint16_t* ws16, float* ws32) {
  if (M <= 0 || N <= 0) return;
  const int64_t Np = (N + 15) / 16 * 16;
  ws16 = line_aligned(ws16);
  const uint16_t* Bv = ws16;
  amx_pack_b(ws16, B, N, K, tb, 0, Np);
  ws16 += amx_packed_b_elems(N, K);
  if (ta && K > 0) {  // A [M, Kp] from A^T [K, M], zeros past K: the product over K padded to Kp
    const int64_t Kp = (K + 31) / 32 * 32;
    transpose_padded(ws16, Kp, A, M, K, M, Kp);
    A = ws16, ws16 += M * Kp, K = Kp;
  }
  amx_matmul_packed(C, A, Bv, M, N, K, accumulate, ws16, ws32);
}

DSTRAIN_AMX void amx_matmul_packed(float* C, const uint16_t* A, const uint16_t* Bv, int64_t M, int64_t N, int64_t K,
                                   bool accumulate, uint16_t* ws16, float* ws32) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M * N; ++i) C[i] = 0.0f;
    return;
  }
  const int64_t Kp = (K + 31) / 32 * 32, Np = (N + 15) / 16 * 16, Mp = (M + 15) / 16 * 16, M16 = M / 16 * 16;
  ws16 = line_aligned(ws16), ws32 = line_aligned(ws32);
  // Whole tiles of rows from A in place where K is a multiple of 32; the rest (all of A
  // otherwise) from a padded copy Ap.
  uint16_t* Ap = ws16;
  const bool in_place = K == Kp;
  if (in_place) copy_padded(Ap, Kp, A + M16 * K, K, M - M16, K, M16 < M ? 16 : 0);
  else copy_padded(Ap, Kp, A, K, M, K, Mp);
  const uint16_t* Amain = in_place ? A : Ap;
  const int64_t lda = in_place ? K : Kp;
  const uint16_t* Atail = in_place ? Ap : Ap + M16 * Kp;
  if (N == Np && M16 > 0) amx_gemm(C, N, Amain, lda, Bv, Kp * 16, M16, N, Kp, accumulate);
  // The rows the direct product did not cover (all of them when N is not a multiple of 16), a
  // tile row at a time through ws32.
  for (int64_t m0 = N == Np ? M16 : 0; m0 < M; m0 += 16) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    rows_in(ws32, Np, C + m0 * N, N, rows, N, accumulate);
    amx_gemm(ws32, Np, m0 < M16 ? Amain + m0 * lda : Atail, m0 < M16 ? lda : Kp, Bv, Kp * 16, 16, Np, Kp, accumulate);
    rows_out(C + m0 * N, N, ws32, Np, rows, N);
  }
}

}  // namespace dstrain::kernels::cpu
