#include "engine/parallel/zero/partition.h"

#include <algorithm>

#include "engine/common/error.h"

namespace dstrain::parallel {

FlatPartition::FlatPartition(int64_t numel, int ranks, int64_t align) : numel_(numel), ranks_(ranks) {
  DS_CHECK(ranks >= 1 && align >= 1 && numel >= 0, "FlatPartition({}, {}, {})", numel, ranks, align);
  const int64_t block = ranks * align;
  per_rank_ = (numel + block - 1) / block * align;
}

std::vector<int64_t> FlatPartition::counts_in(Range r) const {
  std::vector<int64_t> out(size_t(ranks_), 0);
  for (int p = 0; p < ranks_; ++p) out[size_t(p)] = std::max<int64_t>(0, intersect(part(p), r).size());
  return out;
}

}  // namespace dstrain::parallel
