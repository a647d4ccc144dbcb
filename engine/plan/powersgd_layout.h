// PowerSGD's split of a flat gradient buffer (docs/design.md §6.5, "PowerSGD"): which tensors
// are compressed as matrices and which parts are sent whole — pure arithmetic, shared by the
// compression itself (engine/parallel/powersgd.h) and the plan (memory, communication).
#pragma once

#include <cstdint>
#include <vector>

namespace dstrain::plan {

// A gradient tensor of a flat buffer: `elems` elements from `offset`, its first dimension `rows`
// (0 for a tensor of fewer than two dimensions).
struct PowerSgdTensor {
  int64_t offset = 0, elems = 0, rows = 0;
};
struct PowerSgdMatrix {
  int64_t offset = 0, rows = 0, cols = 0, rank = 0;
  int64_t p_offset = 0, q_offset = 0;  // into the P and Q staging
};
struct ElementRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
// Which parts of a buffer of `length` elements are compressed and which are sent whole.
struct PowerSgdLayout {
  std::vector<PowerSgdMatrix> matrices;
  std::vector<ElementRange> whole;  // the rest of [0, length), in order
  int64_t whole_elems = 0, p_elems = 0, q_elems = 0, length = 0;
  uint64_t digest = 0;  // of length and every matrix's offset, shape and rank
  // Elements all-reduced per compressed step: the whole part and P, then Q.
  int64_t compressed_elems() const { return whole_elems + p_elems + q_elems; }
};
// Every tensor of two or more dimensions is a matrix [n, m] (n its first dimension, m the rest,
// as PyTorch views it), compressed at rank r = min(rank, n, m) when
// (n + m) r * min_compression_rate < n m (PyTorch's _should_compress); everything else — and the
// gaps between tensors — is sent whole.
PowerSgdLayout powersgd_layout(std::vector<PowerSgdTensor> tensors, int64_t length, int64_t rank,
                               double min_compression_rate);

}  // namespace dstrain::plan
