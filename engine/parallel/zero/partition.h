// ZeRO partitioning, pure arithmetic (docs/design.md §6.4): a flat buffer of `numel` elements
// split over the ranks of one group into equal partitions, padded so that every partition has
// the same size, a multiple of `align` elements. The one range type of the engine's flat
// buffers lives here too.
#pragma once

#include <cstdint>
#include <vector>

namespace dstrain::parallel {

// [begin, end) of a flat buffer.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
};

// The common part of two ranges (empty, with begin >= end, when they do not meet).
inline Range intersect(Range a, Range b) {
  return {a.begin > b.begin ? a.begin : b.begin, a.end < b.end ? a.end : b.end};
}

class FlatPartition {
 public:
  FlatPartition() = default;  // an empty buffer on one rank
  // Partitions of ceil(numel / (ranks * align)) * align elements each; the last ones may extend
  // past `numel` (padding) or lie entirely in it.
  FlatPartition(int64_t numel, int ranks, int64_t align);

  int ranks() const { return ranks_; }
  int64_t numel() const { return numel_; }
  int64_t part_size() const { return per_rank_; }
  // The buffer length the partitions cover: ranks x part_size >= numel.
  int64_t padded() const { return per_rank_ * ranks_; }
  Range part(int rank) const { return {rank * per_rank_, (rank + 1) * per_rank_}; }
  // How many elements of `r` lie in each rank's part, in rank order: the block counts of an
  // all-gather-v or reduce-scatter-v of the elements `r` in place.
  std::vector<int64_t> counts_in(Range r) const;

 private:
  int64_t numel_ = 0, per_rank_ = 0;
  int ranks_ = 1;
};

}  // namespace dstrain::parallel
