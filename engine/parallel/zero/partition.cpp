#include "engine/parallel/zero/partition.h"

#include <algorithm>

#include "engine/common/error.h"

namespace dstrain::parallel {

std::vector<Range> partition_flat(int64_t numel, int ranks, int64_t align) {
  DS_CHECK(ranks >= 1 && align >= 1 && numel >= 0, "partition_flat({}, {}, {})", numel, ranks, align);
  const int64_t block = ranks * align;
  const int64_t per_rank = (numel + block - 1) / block * align;
  std::vector<Range> out(ranks);
  for (int r = 0; r < ranks; ++r) out[r] = {r * per_rank, (r + 1) * per_rank};
  return out;
}

std::vector<ParamSlice> params_in_range(const std::vector<FlatParam>& params, Range r) {
  std::vector<ParamSlice> out;
  // First parameter ending after r.begin (parameters are sorted by offset and do not overlap).
  auto it = std::lower_bound(params.begin(), params.end(), r.begin,
                             [](const FlatParam& p, int64_t at) { return p.offset + p.numel <= at; });
  for (; it != params.end() && it->offset < r.end; ++it) {
    const int64_t lo = std::max(r.begin, it->offset), hi = std::min(r.end, it->offset + it->numel);
    if (lo >= hi) continue;  // an empty parameter
    out.push_back({it->name, lo - it->offset, hi - it->offset, lo - r.begin});
  }
  return out;
}

}  // namespace dstrain::parallel
