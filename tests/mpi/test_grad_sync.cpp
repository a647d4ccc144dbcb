// The bucketed gradient sync under mpirun -np 2 / 4, on the `small` model's parameter store:
// bucket layout (tiles each buffer, capacity, backward order), and the reduced gradients against
// the sum every rank can compute alone — all-reduce (ZeRO 0/1) and reduce-scatter into the own
// shard (ZeRO 2), with buckets launched as the simulated backward pass reports units final —
// through mapped peer memory and through messages.
#include <gtest/gtest.h>
#include <mpi.h>

#include "engine/config/load_config.h"
#include "engine/model/deepseek_model.h"
#include "engine/parallel/grad_sync.h"
#include "engine/plan/parallel_plan.h"

#include "tests/mpi/mpi_test_util.h"

namespace dstrain::parallel {
namespace {

using dstrain::testing::world_rank;
using dstrain::testing::world_size;

// The gradient element i of rank r: small integers, so every sum is exact in float.
float grad_value(int r, int64_t i, bool expert) { return float((i * 7 + r * 3 + (expert ? 1 : 0)) % 11 - 5); }

struct Fixture {
  config::TrainConfig cfg = config::load_config_file("configs/small.yaml", {"train_batch_size=16"});
  plan::ParallelPlan plan = plan::make_plan(cfg, world_size());
  model::ParamStore params{plan.params, plan.param_stage, cfg.model.num_routed(), model::ShardCoords{}};
  std::unique_ptr<comm::Communicator> dp = comm::make_mpi_communicator(MPI_COMM_WORLD, "dp");
};

TEST(GradSync, BucketsTileTheBuffersInBackwardOrder) {
  Fixture f;
  const int64_t cap = 300000, L = f.cfg.model.num_hidden_layers;
  GradSync sync(f.params, *f.dp, L, {0, true, cap});
  ASSERT_FALSE(sync.buckets().empty());
  for (const bool expert : {false, true}) {
    std::vector<Range> ranges;
    for (const GradBucket& b : sync.buckets())
      if (b.expert == expert) {
        ranges.push_back(b.range);
        EXPECT_LE(b.range.size(), cap);
      }
    std::sort(ranges.begin(), ranges.end(), [](Range a, Range b) { return a.begin < b.begin; });
    int64_t at = 0;
    for (const Range& r : ranges) {
      EXPECT_EQ(r.begin, at);
      at = r.end;
    }
    EXPECT_EQ(at, expert ? f.params.expert_numel() : f.params.dense_numel());
  }
  // The head's buckets come first, the embedding's last; a layer's before the layer below it.
  EXPECT_EQ(sync.buckets().front().units.front(), L);
  EXPECT_EQ(sync.buckets().back().units.back(), L + 1);
}

TEST(GradSync, MakeBucketsClosesAtUnitBoundariesOnceAnEighthFull) {
  // Units 2 | 1 | 0 of 100 elements each, capacity 400: an eighth is 50, so three buckets.
  const std::vector<FlatUnitParam> p = {{0, 100, 0}, {100, 100, 1}, {200, 100, 2}};
  const auto b = make_buckets(p, false, 400);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].range.begin, 200);
  EXPECT_EQ(b[2].range.end, 100);
  // A parameter larger than the capacity is cut; a small tail joins the next unit's bucket.
  const auto c = make_buckets({{0, 10, 0}, {10, 820, 1}}, true, 400);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].range.size(), 400);
  EXPECT_EQ(c[2].range.begin, 0);
  EXPECT_EQ(c[2].units, (std::vector<int64_t>{1, 0}));
}

class GradSyncStages : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(GradSyncStages, ReducedGradientsAreTheSumOverRanks) {
  const auto [zero, overlap, peer_memory] = GetParam();
  Fixture f;
  const int r = world_rank(), P = world_size();
  const int64_t L = f.cfg.model.num_hidden_layers;
  GradSync sync(f.params, *f.dp, L, {zero, overlap, 250000, peer_memory});
  EXPECT_EQ(sync.peer_memory(), peer_memory && P > 1);
  for (int rep = 0; rep < 2; ++rep) {  // twice: the buckets re-arm
    for (const bool expert : {false, true}) {
      auto& g = expert ? f.params.expert_grads() : f.params.dense_grads();
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(r, int64_t(i), expert) * float(rep + 1);
    }
    sync.begin();
    sync.grads_final(L);
    for (int64_t i = L - 1; i >= 0; --i) {
      for (int k = 0; k < 20; ++k) sync.poll();
      sync.grads_final(i);
    }
    sync.grads_final(L + 1);
    sync.finish();
    for (const bool expert : {false, true}) {
      const auto& g = expert ? f.params.expert_grads() : f.params.dense_grads();
      const Range own = expert ? sync.expert_shard() : sync.dense_shard();
      const int64_t n = expert ? f.params.expert_numel() : f.params.dense_numel();
      int64_t bad = 0;
      for (int64_t i = own.begin; i < std::min(own.end, n); ++i) {
        float want = 0;
        for (int q = 0; q < P; ++q) want += grad_value(q, i, expert) * float(rep + 1);
        bad += g[size_t(i)] != want;
      }
      EXPECT_EQ(bad, 0) << (expert ? "expert" : "dense") << " rep " << rep;
      if (zero == 2) {
        EXPECT_EQ(own.size() * P, int64_t(g.size())) << "equal shards";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, GradSyncStages,
                         ::testing::Combine(::testing::Values(0, 2), ::testing::Values(true, false),
                                            ::testing::Values(true, false)));

}  // namespace
}  // namespace dstrain::parallel

