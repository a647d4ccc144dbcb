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
// GCC 12 takes the undefined upper half of _mm512_castsi256_si512 for an uninitialised read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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

}  // namespace

DSTRAIN_AMX void vnni_pack(uint16_t* Bv, int64_t block_stride, const uint16_t* src, int64_t ld, int64_t K, int64_t N,
               int64_t Kp, int64_t Np, bool transposed) {
  // Interleaves two rows of 16: (r0[0], r1[0], r0[1], r1[1], ...) from (r0[0..15], r1[0..15]).
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  // Transposed with an even row stride: a pair (k, k + 1) of row n is one 32-bit word, so a
  // 64-byte row of the layout is 16 such words gathered from 16 rows.
  const bool words = transposed && ld % 2 == 0;
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(int(ld / 2)));
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    uint16_t* block = Bv + (n0 / 16) * block_stride;
    for (int64_t k = 0; k < Kp; k += 2) {
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

DSTRAIN_AMX void amx_gemm(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t block_stride,
              int64_t M, int64_t N, int64_t K, bool accumulate) {
  configure_tiles();
  int64_t m = 0;
  for (; m + 32 <= M; m += 32) tile_row<2>(C + m * ldc, ldc, A + m * lda, lda, Bv, block_stride, N, K, accumulate);
  if (m < M) tile_row<1>(C + m * ldc, ldc, A + m * lda, lda, Bv, block_stride, N, K, accumulate);
  _tile_release();
}

}  // namespace dstrain::kernels::cpu
