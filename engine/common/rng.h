// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011): the value drawn for element
// i of a stream depends only on (key, i), so any rank can generate any slice of a tensor and get
// the same numbers as a single process (docs/design.md §2.3).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace dstrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

// 64-bit key of a named stream: a hash of (seed, name).
uint64_t stream_key(uint64_t seed, std::string_view name);

// Standard normal for element `index` of the stream `key` (Box-Muller on one Philox block).
double normal_at(uint64_t key, uint64_t index);

// Uniform in [0, 1) for element `index` of the stream `key`.
double uniform_at(uint64_t key, uint64_t index);

}  // namespace dstrain
