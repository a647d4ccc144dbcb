#include "engine/common/rng.h"

#include <cmath>

namespace dstrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kM0) * c[0], p1 = uint64_t(kM1) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1],
         uint32_t(p0)};
    k[0] += kW0;
    k[1] += kW1;
  }
  return c;
}

uint64_t stream_key(uint64_t seed, std::string_view name) {
  uint64_t h = 1469598103934665603ull ^ (seed * 0x9E3779B97F4A7C15ull);  // FNV-1a, seeded
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 1099511628211ull;
  }
  return h;
}

namespace {
std::array<uint32_t, 4> block(uint64_t key, uint64_t index) {
  return philox4x32({uint32_t(index), uint32_t(index >> 32), 0u, 0u},
                    {uint32_t(key), uint32_t(key >> 32)});
}
// 53-bit uniform in [0, 1) from two 32-bit words.
double to_unit(uint32_t hi, uint32_t lo) {
  return double((uint64_t(hi) << 21) ^ (lo >> 11)) * 0x1.0p-53;
}
}  // namespace

double uniform_at(uint64_t key, uint64_t index) {
  const auto r = block(key, index);
  return to_unit(r[0], r[1]);
}

double normal_at(uint64_t key, uint64_t index) {
  const auto r = block(key, index);
  const double u1 = 1.0 - to_unit(r[0], r[1]);  // (0, 1]
  const double u2 = to_unit(r[2], r[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace dstrain
