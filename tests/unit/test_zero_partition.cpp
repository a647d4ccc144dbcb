// ZeRO partition math: equal aligned padded partitions that tile the buffer, and the mapping of
// partitions back to parameters at every boundary.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/parallel/zero/partition.h"

namespace dstrain::parallel {
namespace {

TEST(ZeroPartition, EqualAlignedPartitionsTileThePaddedBuffer) {
  for (int64_t numel : {0, 1, 7, 100, 1000, 15797120})
    for (int ranks : {1, 2, 3, 4, 8})
      for (int64_t align : {1, 4, 16, 128}) {
        const auto parts = partition_flat(numel, ranks, align);
        ASSERT_EQ(int(parts.size()), ranks);
        EXPECT_EQ(parts[0].begin, 0);
        for (int r = 0; r < ranks; ++r) {
          EXPECT_EQ(parts[r].size(), parts[0].size());
          EXPECT_EQ(parts[r].size() % align, 0);
          if (r > 0) {
            EXPECT_EQ(parts[r].begin, parts[r - 1].end);
          }
        }
        const int64_t padded = parts.back().end;
        EXPECT_GE(padded, numel);
        EXPECT_LT(padded - numel, ranks * align);  // padding below one block per rank
      }
}

// Partitions of a buffer of random parameter sizes: every element of every parameter lands in
// exactly one partition, at the right offset.
TEST(ZeroPartition, ParamSlicesCoverEveryElementOnce) {
  std::mt19937 rng(5);
  std::vector<FlatParam> params;
  int64_t offset = 0;
  for (int i = 0; i < 60; ++i) {
    const int64_t n = i % 7 == 0 ? 0 : 1 + int64_t(rng() % 300);
    std::string name = "p";
    name += std::to_string(i);
    params.push_back({name, offset, n});
    offset += n;
  }
  for (int ranks : {1, 2, 3, 5, 8}) {
    std::map<std::string, std::vector<int>> seen;
    for (const auto& p : params) seen[p.name].assign(p.numel, 0);
    for (const Range& r : partition_flat(offset, ranks, 8)) {
      for (const ParamSlice& s : params_in_range(params, r)) {
        ASSERT_GT(s.count(), 0);
        ASSERT_GE(s.range_offset, 0);
        ASSERT_LE(s.range_offset + s.count(), r.size());
        const FlatParam& p = *std::find_if(params.begin(), params.end(), [&](auto& q) { return q.name == s.name; });
        EXPECT_EQ(r.begin + s.range_offset, p.offset + s.param_begin);  // same flat element
        for (int64_t i = s.param_begin; i < s.param_end; ++i) ++seen[s.name][i];
      }
    }
    for (const auto& [name, counts] : seen)
      for (int c : counts) ASSERT_EQ(c, 1) << name << " with " << ranks << " ranks";
  }
}

TEST(ZeroPartition, RangeInsideOneParameterAndPastTheEnd) {
  const std::vector<FlatParam> params = {{"a", 0, 10}, {"b", 10, 100}, {"c", 110, 5}};
  auto s = params_in_range(params, {20, 30});
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].name, "b");
  EXPECT_EQ(s[0].param_begin, 10);
  EXPECT_EQ(s[0].param_end, 20);
  s = params_in_range(params, {112, 200});  // padding after the last parameter
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].name, "c");
  EXPECT_EQ(s[0].count(), 3);
  EXPECT_TRUE(params_in_range(params, {115, 128}).empty());
}

}  // namespace
}  // namespace dstrain::parallel
