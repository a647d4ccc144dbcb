// Communicators under MPI: for every layout that fits the world size this test is launched
// with (mpirun -np 1/2/4/8), each rank builds its five groups and checks them — members in
// plan order (allgather of world ranks), and a sum all-reduce over each group.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "engine/comm/mpi_check.h"
#include "engine/comm/process_groups.h"
#include "engine/runtime/rank_engine.h"

#include "tests/mpi/mpi_test_util.h"

namespace dstrain {
namespace {

using testing::world_rank;
using testing::world_size;

std::vector<plan::Degrees> layouts_for(int world) {
  std::vector<plan::Degrees> out;
  for (int tp = 1; tp <= world; ++tp)
    for (int pp = 1; pp <= world; ++pp) {
      if (world % (tp * pp)) continue;
      const int dp = world / (tp * pp);
      for (int ep = 1; ep <= dp; ++ep)
        if (dp % ep == 0) out.push_back({tp, pp, dp, ep});
    }
  return out;
}

TEST(ProcessGroups, MatchThePlanForEveryLayout) {
  const int world = world_size(), me = world_rank();
  const auto layouts = layouts_for(world);
  ASSERT_FALSE(layouts.empty());
  for (const plan::Degrees& d : layouts) {
    const plan::RankGrid grid(d);
    const auto specs = runtime::group_specs(grid, me);
    std::vector<comm::ProcessGroup> groups = comm::create_groups(specs);
    ASSERT_EQ(groups.size(), 5u);
    for (size_t i = 0; i < groups.size(); ++i) {
      const comm::ProcessGroup& g = groups[i];
      ASSERT_NO_THROW(g.verify()) << g.name();
      EXPECT_EQ(g.size(), grid.group_size(plan::kAllAxes[i]));
      EXPECT_EQ(g.world_ranks()[g.rank()], me);
      const int64_t sum = comm::all_reduce_value(*g.communicator("check"), int64_t(me), comm::ReduceOp::kSum);
      int64_t expected = 0;
      for (int r : g.world_ranks()) expected += r;
      EXPECT_EQ(sum, expected) << g.name() << " tp" << d.tp << " pp" << d.pp << " dp" << d.dp;
    }
  }
}

TEST(ProcessGroups, SpecWithoutThisRankIsRejected) {
  comm::GroupSpec bad{"tp", 0, {world_size()}};  // a rank that does not exist
  EXPECT_THROW(comm::ProcessGroup{bad}, CommError);
}

}  // namespace
}  // namespace dstrain
