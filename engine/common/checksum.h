// End-to-end checksums of what a checkpoint holds (docs/checkpoint-format.md, "Checksums"): a
// tensor's checksum is a sum over its elements of a 64-bit mix of (flat index, fp32 bits), so
// that any block of it — a rank's shard, a ZeRO partition's part — contributes a partial sum of
// its own, and the partial sums of blocks that tile the tensor add up to the whole. The run
// attributes are checksummed with FNV-1a over a canonical form.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

// MurmurHash3's 64-bit finaliser: a bijection of 64-bit words with full avalanche.
inline uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return k;
}

inline constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ULL;
// FNV-1a over `bytes`, continuing from `h`.
uint64_t fnv1a64(std::string_view bytes, uint64_t h = kFnvOffset);

// The term of element i with value bits b: fmix64(i * 0x9E3779B97F4A7C15 + b) (mod 2^64).
inline uint64_t sum64_term(uint64_t index, uint32_t bits) { return fmix64(index * 0x9E3779B97F4A7C15ULL + bits); }

// Σ sum64_term(first_index + j, bits(x[j])) over j in [0, n), mod 2^64.
uint64_t sum64(const float* x, int64_t n, uint64_t first_index = 0);

// The same over elements [begin, end) (row-major order inside the block) of a block of a tensor:
// the block of extent `count` at `offset` of a tensor of shape `full` (any rank; a 0-d tensor is
// one element), indices being flat indices of the whole tensor. Whole block: begin 0, end -1.
uint64_t sum64_block(const float* block, const std::vector<int64_t>& full, const std::vector<int64_t>& offset,
                     const std::vector<int64_t>& count, int64_t begin = 0, int64_t end = -1);

// 16 lower-case hex digits, and back (false unless exactly 16 hex digits).
std::string hex64(uint64_t v);
bool parse_hex64(std::string_view s, uint64_t* out);

}  // namespace dstrain
