// The rank grid: docs/design.md §2.1's order for every small layout, and the group structure.
#include <gtest/gtest.h>

#include <set>

#include "engine/plan/rank_grid.h"

namespace dstrain::plan {
namespace {

std::vector<Degrees> layouts(int max_world) {
  std::vector<Degrees> out;
  for (int tp = 1; tp <= 8; tp *= 2)
    for (int pp = 1; pp <= 8; ++pp)
      for (int dp = 1; dp <= 16; ++dp)
        for (int ep = 1; ep <= dp; ++ep)
          if (dp % ep == 0 && tp * pp * dp <= max_world) out.push_back({tp, pp, dp, ep});
  return out;
}

std::string describe(const Degrees& d) {
  return "tp" + std::to_string(d.tp) + " pp" + std::to_string(d.pp) + " dp" + std::to_string(d.dp) +
         " ep" + std::to_string(d.ep);
}

TEST(RankGrid, RankFormulaAndCoordinatesAgree) {
  for (const Degrees& d : layouts(64)) {
    const RankGrid g(d);
    for (int r = 0; r < g.world_size(); ++r) {
      const Coord c = g.coord(r);
      ASSERT_EQ(r, (c.pp * d.dp + c.dp) * d.tp + c.tp) << describe(d);
      ASSERT_EQ(g.rank_of(c.tp, c.dp, c.pp), r);
      ASSERT_EQ(c.ep, c.dp % d.ep);
      ASSERT_EQ(c.edp, c.dp / d.ep);
    }
  }
}

// Each axis' groups partition the world; a rank sits in its group at its coordinate; the
// members differ from it only on that axis.
TEST(RankGrid, GroupsPartitionTheWorld) {
  for (const Degrees& d : layouts(64)) {
    const RankGrid g(d);
    for (Axis a : kAllAxes) {
      std::vector<int> seen(g.world_size(), 0);
      for (int i = 0; i < g.num_groups(a); ++i) {
        const auto members = g.group(a, i);
        ASSERT_EQ(static_cast<int>(members.size()), g.group_size(a));
        for (size_t pos = 0; pos < members.size(); ++pos) {
          const int r = members[pos];
          ++seen[r];
          ASSERT_EQ(g.group_index(a, r), i) << describe(d) << " " << axis_name(a);
          const Coord c = g.coord(r), first = g.coord(members[0]);
          const int coord_on_axis = a == Axis::kTensor     ? c.tp
                                    : a == Axis::kData     ? c.dp
                                    : a == Axis::kPipeline ? c.pp
                                    : a == Axis::kExpert   ? c.ep
                                                           : c.edp_rank(d);
          ASSERT_EQ(coord_on_axis, static_cast<int>(pos));
          if (a != Axis::kTensor && a != Axis::kExpertData) { ASSERT_EQ(c.tp, first.tp); }
          if (a != Axis::kPipeline) { ASSERT_EQ(c.pp, first.pp); }
          if (a == Axis::kTensor || a == Axis::kPipeline) { ASSERT_EQ(c.dp, first.dp); }
          if (a == Axis::kExpert) { ASSERT_EQ(c.edp, first.edp); }
          if (a == Axis::kExpertData) { ASSERT_EQ(c.ep, first.ep); }
        }
      }
      for (int r = 0; r < g.world_size(); ++r) ASSERT_EQ(seen[r], 1) << describe(d);
    }
  }
}

// Expert groups are carved out of data-parallel groups; the expert-data groups of an EP group's
// members tile the whole stage (every tensor- and data-parallel rank of it): each rank of a stage
// holds exactly one EP block of experts, shared with the other ranks of its expert-data group.
TEST(RankGrid, ExpertGroupsLieInsideDataParallelGroups) {
  for (const Degrees& d : layouts(64)) {
    const RankGrid g(d);
    for (int r = 0; r < g.world_size(); ++r) {
      const auto dp = g.group_of(Axis::kData, r);
      const std::set<int> dp_set(dp.begin(), dp.end());
      std::set<int> covered, stage;
      for (int x = 0; x < g.world_size(); ++x)
        if (g.coord(x).pp == g.coord(r).pp) stage.insert(x);
      for (int e : g.group_of(Axis::kExpert, r)) {
        ASSERT_TRUE(dp_set.count(e));
        for (int x : g.group_of(Axis::kExpertData, e)) covered.insert(x);
      }
      ASSERT_EQ(covered, stage) << describe(d);
    }
  }
}

TEST(RankGrid, TensorParallelRanksAreAdjacent) {
  const RankGrid g({4, 2, 2, 1});
  for (int i = 0; i < g.num_groups(Axis::kTensor); ++i) {
    const auto m = g.group(Axis::kTensor, i);
    for (size_t k = 1; k < m.size(); ++k) EXPECT_EQ(m[k], m[k - 1] + 1);
  }
}

// The worked example of TP=2 x PP=2 x DP=2 from docs/design.md §2.1.
TEST(RankGrid, Tp2Pp2Dp2Example) {
  const RankGrid g({2, 2, 2, 2});
  EXPECT_EQ(g.group(Axis::kTensor, 1), (std::vector<int>{2, 3}));
  EXPECT_EQ(g.group_of(Axis::kData, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(g.group_of(Axis::kPipeline, 3), (std::vector<int>{3, 7}));
  EXPECT_EQ(g.group_of(Axis::kExpert, 4), (std::vector<int>{4, 6}));
  EXPECT_EQ(g.group_of(Axis::kExpertData, 4), (std::vector<int>{4, 5}));
}

}  // namespace
}  // namespace dstrain::plan
