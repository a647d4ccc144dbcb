#include "engine/common/checksum.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace dstrain {

uint64_t fnv1a64(std::string_view bytes, uint64_t h) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return h;
}

uint64_t sum64(const float* x, int64_t n, uint64_t first_index) {
  uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static) if (n > (1 << 16))
  for (int64_t j = 0; j < n; ++j) {
    uint32_t b;
    std::memcpy(&b, x + j, 4);
    s += sum64_term(first_index + uint64_t(j), b);
  }
  return s;
}

uint64_t sum64_block(const float* block, const std::vector<int64_t>& full, const std::vector<int64_t>& offset,
                     const std::vector<int64_t>& count, int64_t begin, int64_t end) {
  if (full.size() != offset.size() || full.size() != count.size())
    throw std::invalid_argument("sum64_block: shape, offset and count differ in rank");
  const int nd = int(full.size());
  if (nd == 0) return begin > 0 || end == 0 ? 0 : sum64(block, 1, 0);
  int64_t numel = 1;
  for (int64_t c : count) numel *= c;
  if (end < 0 || end > numel) end = numel;
  if (begin >= end) return 0;
  std::vector<int64_t> fstride(size_t(nd), 1);  // the tensor's row-major strides
  for (int d = nd - 2; d >= 0; --d) fstride[size_t(d)] = fstride[size_t(d + 1)] * full[size_t(d + 1)];
  const int64_t width = count[size_t(nd - 1)];  // a block row: contiguous in the block and in the tensor
  if (width == 0) return 0;
  const int64_t first_row = begin / width, last_row = (end - 1) / width;
  uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static) if (end - begin > (1 << 16))
  for (int64_t row = first_row; row <= last_row; ++row) {
    // The tensor's flat index of the row's first element.
    int64_t rem = row, index = offset[size_t(nd - 1)];
    for (int d = nd - 2; d >= 0; --d) {
      index += (offset[size_t(d)] + rem % count[size_t(d)]) * fstride[size_t(d)];
      rem /= count[size_t(d)];
    }
    const int64_t lo = std::max(begin, row * width), hi = std::min(end, (row + 1) * width);
    const float* x = block + lo;
    const uint64_t first = uint64_t(index + (lo - row * width));
    for (int64_t j = 0; j < hi - lo; ++j) {
      uint32_t b;
      std::memcpy(&b, x + j, 4);
      s += sum64_term(first + uint64_t(j), b);
    }
  }
  return s;
}

std::string hex64(uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[size_t(i)] = digits[v & 15];
  return out;
}

bool parse_hex64(std::string_view s, uint64_t* out) {
  if (s.size() != 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return false;
    v = v << 4 | uint64_t(d);
  }
  *out = v;
  return true;
}

}  // namespace dstrain
