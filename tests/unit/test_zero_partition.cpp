// ZeRO partition math: equal aligned padded partitions that tile the buffer, and the block
// counts of any range over the partitions (what the gathers and reduce-scatters send).
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "engine/parallel/zero/partition.h"

namespace dstrain::parallel {
namespace {

TEST(ZeroPartition, EqualAlignedPartitionsTileThePaddedBuffer) {
  for (int64_t numel : {0, 1, 7, 100, 1000, 15797120})
    for (int ranks : {1, 2, 3, 4, 8})
      for (int64_t align : {1, 4, 16, 128}) {
        const FlatPartition p(numel, ranks, align);
        ASSERT_EQ(p.ranks(), ranks);
        EXPECT_EQ(p.part(0).begin, 0);
        for (int r = 0; r < ranks; ++r) {
          EXPECT_EQ(p.part(r).size(), p.part_size());
          EXPECT_EQ(p.part(r).size() % align, 0);
          if (r > 0) {
            EXPECT_EQ(p.part(r).begin, p.part(r - 1).end);
          }
        }
        EXPECT_EQ(p.part(ranks - 1).end, p.padded());
        EXPECT_GE(p.padded(), numel);
        EXPECT_LT(p.padded() - numel, ranks * align);  // padding below one block per rank
      }
}

// Any range of the buffer splits into per-rank blocks that add up to it, each block the
// overlap with that rank's part — at every boundary.
TEST(ZeroPartition, CountsOfARangeAreItsOverlapWithEachPart) {
  std::mt19937 rng(5);
  for (int ranks : {1, 2, 3, 5, 8}) {
    const FlatPartition p(1000 + int64_t(rng() % 1000), ranks, 8);
    for (int trial = 0; trial < 200; ++trial) {
      int64_t a = int64_t(rng() % uint64_t(p.padded() + 1)), b = int64_t(rng() % uint64_t(p.padded() + 1));
      if (a > b) std::swap(a, b);
      const std::vector<int64_t> counts = p.counts_in({a, b});
      ASSERT_EQ(int(counts.size()), ranks);
      EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t(0)), b - a);
      for (int r = 0; r < ranks; ++r) {
        int64_t n = 0;
        for (int64_t i = a; i < b; ++i) n += i >= p.part(r).begin && i < p.part(r).end;
        EXPECT_EQ(counts[size_t(r)], n) << "rank " << r << " of [" << a << ", " << b << ")";
      }
    }
  }
  const FlatPartition p(100, 4, 1);  // parts of 25
  EXPECT_EQ(p.counts_in({20, 30}), (std::vector<int64_t>{5, 5, 0, 0}));
  EXPECT_EQ(p.counts_in({0, 0}), (std::vector<int64_t>{0, 0, 0, 0}));
}

TEST(ZeroPartition, IntersectOfRanges) {
  EXPECT_EQ(intersect({0, 10}, {5, 20}).size(), 5);
  EXPECT_TRUE(intersect({0, 10}, {10, 20}).empty());
  EXPECT_TRUE(intersect({0, 10}, {15, 20}).empty());
}

}  // namespace
}  // namespace dstrain::parallel
