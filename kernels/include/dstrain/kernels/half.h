// bf16 and IEEE fp16 as 16-bit patterns: the scalar conversions from and to fp32, one definition
// for the CPU backend's kernels (kernels/cpu/low_precision.h, which adds the vector forms) and the
// host communicator's 16-bit reductions (engine/comm/mpi_communicator.cpp).
//
// To 16 bits: round to nearest even; NaN stays NaN (quiet), infinities and overflow go to
// infinity (fp16 above 65504 rounds to inf, as IEEE says), fp16 keeps subnormals. From 16 bits:
// exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dstrain::kernels {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
inline float float_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline uint16_t to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN, kept quiet
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                   // nearest, ties to even
}

inline float from_bf16(uint16_t h) { return float_from_bits(uint32_t(h) << 16); }

inline uint16_t to_fp16(float x) {
  const uint32_t u = float_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN, kept quiet
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // from 65520 (the tie above 65504, odd): inf
  if (a < 0x38800000u)  // below 2^-14: a multiple of 2^-24, rounded (nearbyint: to even)
    return uint16_t(sign | uint32_t(std::nearbyint(float_from_bits(a) * 16777216.0f)));
  const uint32_t m = a - 0x38000000u;  // exponent rebiased from 127 to 15
  return uint16_t(sign | ((m + 0xfffu + ((m >> 13) & 1u)) >> 13));  // a carry moves to the next binade
}

inline float from_fp16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return float_from_bits(sign | float_bits(float(m) * 5.9604644775390625e-8f));  // m x 2^-24
  if (e == 31) return float_from_bits(sign | 0x7f800000u | (m << 13));
  return float_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace dstrain::kernels
