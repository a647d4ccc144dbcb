// The bucketed gradient sync under mpirun -np 2 / 4, on the `small` model's parameter store
// (with 8 routed experts instead of 32: 3.5 M expert parameters, still many buckets per buffer):
// bucket layout (tiles each buffer, capacity, backward order), and the reduced gradients against
// the sum every rank can compute alone — all-reduce (ZeRO 0/1) and reduce-scatter into the own
// shard (ZeRO 2), with buckets launched as the simulated backward pass reports layers final —
// through mapped peer memory and through messages; and, with expert parallelism 2, the expert
// buffer reduced over the expert-data-parallel group only.
#include <gtest/gtest.h>

#include "engine/config/load_config.h"
#include "engine/config/presets.h"
#include "engine/model/deepseek_model.h"
#include "engine/parallel/grad_sync.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/rank_engine.h"

#include "tests/mpi/mpi_test_util.h"
#include "tests/mpi/powersgd_reference.h"

namespace dstrain::parallel {
namespace {

using dstrain::testing::world_rank;
using dstrain::testing::world_size;

// The gradient element i of rank r: small integers, so every sum is exact in float.
float grad_value(int r, int64_t i, bool expert) { return float((i * 7 + r * 3 + (expert ? 1 : 0)) % 11 - 5); }

// The small model's store (8 routed experts) on this rank of a DP (x EP) layout over the world, with the groups
// the plan gives it.
struct Fixture {
  explicit Fixture(int zero, int ep = 1, std::vector<std::string> extra = {})
      : cfg(config::load_config_file("configs/small.yaml",
                                     with(extra, {"train_batch_size=16", "model.n_routed_experts=8",
                                                  "parallel.expert=" + std::to_string(ep)}))),
        plan(plan::make_plan(cfg, world_size())),
        coord(plan.grid.coord(world_rank())),
        groups(comm::create_groups(runtime::group_specs(plan.grid, world_rank()))),
        params(plan.params, plan.param_stage, cfg.model.num_routed(), {coord.pp, coord.tp, 1, coord.ep, ep}) {
    dp = groups[1].communicator("dp");   // plan::kAllAxes order: tp, dp, pp, ep, edp
    edp = groups[4].communicator("edp");
    sharding = std::make_unique<ZeroSharding>(zero, params.dense_numel(), params.expert_numel(), *dp, *edp);
    params.pad(sharding->buffer_length(false), sharding->buffer_length(true));
  }
  static std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }
  // The world ranks whose gradients a buffer's sum holds: its group's members.
  const std::vector<int>& members(bool expert) const { return groups[expert ? 4 : 1].world_ranks(); }

  config::TrainConfig cfg;
  plan::ParallelPlan plan;
  plan::Coord coord;
  std::vector<comm::ProcessGroup> groups;
  model::ParamStore params;
  std::unique_ptr<comm::Communicator> dp, edp;
  std::unique_ptr<ZeroSharding> sharding;
};

TEST(GradSync, BucketsTileTheBuffersInBackwardOrder) {
  Fixture f(0);
  const int64_t cap = 300000, L = f.cfg.model.num_hidden_layers;
  GradSync sync(f.params, *f.sharding, model::DeepSeekModel::backward_order(f.cfg.model), {true, cap});
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
  // The head's buckets come first (layer L: the final norm and lm_head without MTP), the
  // embedding's (layer -1) last; a layer's before the layer below it.
  EXPECT_EQ(sync.buckets().front().layers.front(), L);
  EXPECT_EQ(sync.buckets().back().layers.back(), -1);
}

TEST(GradSync, BackwardOrderPutsTheHeadAndMtpFirstAndTheEmbeddingLast) {
  config::ModelConfig m = config::model_preset("tiny");
  m.num_nextn_predict_layers = 2;  // layers 0, 1; MTP 2, 3; head 4
  EXPECT_EQ(model::DeepSeekModel::backward_order(m), (std::vector<int64_t>{4, 3, 2, 1, 0, -1}));
}

TEST(GradSync, MakeBucketsClosesAtLayerBoundariesOnceAnEighthFull) {
  // Layers 2 | 1 | 0 of 100 elements each, capacity 400: an eighth is 50, so three buckets.
  const std::vector<FlatLayerParam> p = {{0, 100, 0}, {100, 100, 1}, {200, 100, 2}};
  const auto b = make_buckets(p, false, 400);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].range.begin, 200);
  EXPECT_EQ(b[2].range.end, 100);
  // A parameter larger than the capacity is cut; a small tail joins the next layer's bucket.
  const auto c = make_buckets({{0, 10, 0}, {10, 820, 1}}, true, 400);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].range.size(), 400);
  EXPECT_EQ(c[2].range.begin, 0);
  EXPECT_EQ(c[2].layers, (std::vector<int64_t>{1, 0}));
}

// Fills the gradients, runs a simulated backward pass through the sync, checks the sums.
void check_reduction(Fixture& f, GradSync& sync, int rep) {
  const int r = world_rank();
  for (const bool expert : {false, true}) {
    auto& g = expert ? f.params.expert_grads() : f.params.dense_grads();
    for (size_t i = 0; i < size_t(g.size()); ++i) g.host()[i] = grad_value(r, int64_t(i), expert) * float(rep + 1);
  }
  sync.begin();
  for (int64_t layer : model::DeepSeekModel::backward_order(f.cfg.model)) {
    for (int k = 0; k < 20; ++k) sync.poll();
    sync.grads_final(layer);
  }
  sync.finish();
  for (const bool expert : {false, true}) {
    const auto& g = expert ? f.params.expert_grads() : f.params.dense_grads();
    const Range own = f.sharding->shards_gradients() ? f.sharding->shard(expert) : Range{0, int64_t(g.size())};
    const int64_t n = expert ? f.params.expert_numel() : f.params.dense_numel();
    int64_t bad = 0;
    for (int64_t i = own.begin; i < std::min(own.end, n); ++i) {
      float want = 0;
      for (int q : f.members(expert)) want += grad_value(q, i, expert) * float(rep + 1);
      bad += g.host()[size_t(i)] != want;
    }
    EXPECT_EQ(bad, 0) << (expert ? "expert" : "dense") << " rep " << rep;
  }
}

class GradSyncStages : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

TEST_P(GradSyncStages, ReducedGradientsAreTheSumOverRanks) {
  const auto [zero, overlap, peer_memory] = GetParam();
  Fixture f(zero);
  GradSync sync(f.params, *f.sharding, model::DeepSeekModel::backward_order(f.cfg.model),
                {overlap, 250000, peer_memory});
  EXPECT_EQ(sync.peer_memory(), peer_memory && world_size() > 1);
  if (zero == 2) {
    EXPECT_EQ(f.sharding->shard(false).size() * world_size(), int64_t(f.params.dense_grads().size())) << "equal shards";
  }
  for (int rep = 0; rep < 2; ++rep) check_reduction(f, sync, rep);  // twice: the buckets re-arm
}

INSTANTIATE_TEST_SUITE_P(Zero, GradSyncStages,
                         ::testing::Combine(::testing::Values(0, 2), ::testing::Values(true, false),
                                            ::testing::Values(true, false)));

// gradient_compression: powersgd on the small model's buffers (ZeRO-1; with EP 2 the expert
// buffer over the expert-data group): before start_iter the buckets' exact sums; from it on the
// compressed step, whose result and errors equal a naive PowerSGD of the group's inputs
// (tests/mpi/powersgd_reference.h) — lossy at rank 4 — and the matrices' layout is the one the
// plan counts.
TEST(GradSync, PowerSgdStepsAfterStartIterAndMatchesANaivePowerSgd) {
  for (const int ep : {1, 2}) {
    if (world_size() % ep) continue;
    Fixture f(1, ep, {"zero_optimization.stage=1", "gradient_compression.rank=4", "gradient_compression.start_iter=1"});
    auto be = kernels::make_cpu_backend(1);
    GradSyncOptions o{true, 250000, true, kernels::DType::kF32, be.get()};
    o.powersgd = PowerSgdOptions{4, 1, 2.0, true, true, 11};
    GradSync sync(f.params, *f.sharding, model::DeepSeekModel::backward_order(f.cfg.model), o);
    ASSERT_EQ(sync.compressors().size(), world_size() / ep > 1 ? 2u : 1u);  // (EP 2 on 2 ranks: no expert group)
    check_reduction(f, sync, 0);  // step 0: exact sums
    EXPECT_FALSE(sync.compressing());
    const int r = world_rank();
    for (const bool expert : {false, true}) {
      auto& g = expert ? f.params.expert_grads() : f.params.dense_grads();
      for (size_t i = 0; i < size_t(g.size()); ++i) g.host()[i] = grad_value(r, int64_t(i), expert) * 0.25f;
    }
    sync.begin(1, 1.0);
    EXPECT_TRUE(sync.compressing());
    for (int64_t layer : model::DeepSeekModel::backward_order(f.cfg.model)) sync.grads_final(layer);
    sync.finish();
    auto state = sync.compression_state();
    for (size_t c = 0; c < sync.compressors().size(); ++c) {
      const PowerSgd& p = *sync.compressors()[c];
      const bool expert = p.name() == "expert";
      comm::Communicator& group = expert ? *f.edp : *f.dp;
      ASSERT_GT(p.layout().matrices.size(), 0u);
      EXPECT_LT(p.layout().compressed_elems() * 10, p.layout().length) << "at least 10x fewer values sent";
      const std::vector<float>& err = state.at("error_" + p.name());
      ASSERT_EQ(int64_t(err.size()), p.layout().length);
      // (the reference's rank index is the position in the group)
      const std::vector<int>& members = f.members(expert);
      // (the reference in double is slow: the parts sent whole and the first six matrices)
      PowerSgdLayout sub = p.layout();
      sub.matrices.resize(std::min<size_t>(sub.matrices.size(), 6));
      std::vector<char> checked(size_t(sub.length), 0);
      for (const auto& w : sub.whole) std::fill(checked.begin() + w.begin, checked.begin() + w.end, 1);
      for (const PowerSgdMatrix& x : sub.matrices)
        std::fill(checked.begin() + x.offset, checked.begin() + x.offset + x.rows * x.cols, 1);
      testing::PowerSgdReference ref(sub, group.size(), 11, p.name());
      const std::vector<double> want =
          ref.step(1, [&](int q, int64_t i) { return grad_value(members[size_t(q)], i, expert) * 0.25f; });
      const auto& g = expert ? f.params.expert_grads() : f.params.dense_grads();
      double worst = 0, worst_error = 0, lost = 0, largest = 0;
      for (int64_t i = 0; i < p.layout().length; ++i) {
        if (!checked[size_t(i)]) continue;
        double sum = 0;
        for (int q : members) sum += grad_value(q, i, expert) * 0.25;
        worst = std::max(worst, std::abs(double(g.host()[size_t(i)]) - want[size_t(i)]));
        worst_error = std::max(worst_error, std::abs(double(err[size_t(i)]) - ref.e[size_t(group.rank())][size_t(i)]));
        lost = std::max(lost, std::abs(double(g.host()[size_t(i)]) - sum));
        largest = std::max(largest, std::abs(want[size_t(i)]));
      }
      EXPECT_LT(worst, 1e-5 * largest) << p.name();
      EXPECT_LT(worst_error, 1e-5 * largest) << p.name();
      EXPECT_GT(lost, 0.1) << p.name();
      // The plan's split of this rank's buffer is the same (memory, runtime::planned_step_communication).
      EXPECT_EQ(f.plan.powersgd_layouts(world_rank())[expert ? 1 : 0].digest, p.layout().digest) << p.name();
      bool compared = false;
      for (const auto& t : runtime::planned_step_communication(f.plan, world_rank()))
        if (t.group == (expert ? "edp" : "dp") && t.op == "all_reduce") {
          EXPECT_EQ(t.bytes, 4.0 * double(p.layout().compressed_elems())) << p.name();
          compared = true;
        }
      EXPECT_TRUE(compared) << p.name();
    }
  }
}

// Expert parallelism 2: each rank holds half the experts; the dense buffer reduces over every
// rank, the expert buffer over the ranks that hold the same experts.
TEST(GradSync, ExpertGradientsReduceOverTheExpertDataParallelGroup) {
  if (world_size() % 2) GTEST_SKIP() << "needs an even world";
  for (const int zero : {0, 2}) {
    Fixture f(zero, 2);
    EXPECT_EQ(int(f.members(true).size()), world_size() / 2);
    GradSync sync(f.params, *f.sharding, model::DeepSeekModel::backward_order(f.cfg.model), {true, 250000});
    check_reduction(f, sync, 0);
  }
}

// communication_data_type bf16 / fp16: the buckets are reduced in 16-bit staging slots (more
// buckets than slots, so launches wait for slots) and widened back — ZeRO-2 into the own shard.
// Small integers are exact in 16 bits: the sums are the fp32 ones; a value 16 bits cannot hold
// (1 + 2^-12) arrives rounded, so the sum of P of them is exactly P.
TEST(GradSync, SixteenBitBucketsAreSummedInTheirStagingSlots) {
  auto backend = kernels::make_cpu_backend(1);
  for (const kernels::DType dtype : {kernels::DType::kBF16, kernels::DType::kF16}) {
    for (const int zero : {0, 2}) {
      for (const bool peer_memory : {true, false}) {
        Fixture f(zero);
        GradSync sync(f.params, *f.sharding, model::DeepSeekModel::backward_order(f.cfg.model),
                      {true, 250000, peer_memory, dtype, backend.get()});
        ASSERT_GT(sync.buckets().size(), size_t(GradSync::kWireSlots));
        EXPECT_EQ(sync.buffer_bytes(), 2 * GradSync::kWireSlots * 250016);
        check_reduction(f, sync, 0);
        auto& g = f.params.dense_grads();
        std::fill(g.host().begin(), g.host().end(), 1.0f + 1.0f / 4096);
        sync.begin();
        sync.finish();
        const Range own = f.sharding->shards_gradients() ? f.sharding->shard(false) : Range{0, int64_t(g.size())};
        int64_t bad = 0;
        for (int64_t i = own.begin; i < std::min(own.end, f.params.dense_numel()); ++i)
          bad += g.host()[size_t(i)] != float(world_size());
        EXPECT_EQ(bad, 0) << kernels::to_string(dtype) << " zero " << zero << " peer memory " << peer_memory;
      }
    }
  }
}

// ZeRO-2 holding a shard: each micro-batch's gradients are reduce-scattered as the backward pass
// finishes them, into the own part, which sums the micro-batches; the rest of each bucket is
// zeroed and its memory given back, so between reductions a rank holds its shard and little else.
// Three micro-batches, each adding its gradients to the buffer as a backward pass does: the own
// part ends as the sum over ranks and micro-batches, every other element is zero, and the
// buffers' resident memory is below half of them (the shard of two ranks and a bucket or two).
TEST(GradSync, ZeroTwoHoldsItsShardAndReducesEveryMicroBatch) {
  if (world_size() < 2) GTEST_SKIP() << "needs a data-parallel group";
  auto backend = kernels::make_cpu_backend(1);
  const int r = world_rank(), kMicro = 3;
  for (const kernels::DType dtype : {kernels::DType::kF32, kernels::DType::kBF16}) {
    for (const bool peer_memory : {true, false}) {
      const std::string what = std::string(kernels::to_string(dtype)) + (peer_memory ? ", peer memory" : ", messages");
      Fixture f(2);
      GradSync sync(f.params, *f.sharding, model::DeepSeekModel::backward_order(f.cfg.model),
                    {true, 250000, peer_memory, dtype, backend.get(), true});
      ASSERT_TRUE(sync.holds_shard()) << what;
      EXPECT_TRUE(sync.every_micro_batch());
      sync.zero_grads();
      sync.begin();
      for (int mb = 0; mb < kMicro; ++mb) {
        for (int64_t layer : model::DeepSeekModel::backward_order(f.cfg.model)) {
          for (const std::string& name : f.params.names()) {  // the layer's gradients, added
            const model::ParamView& v = f.params.view(name);
            if (v.buffer || v.info->layer != layer) continue;
            auto g = (v.expert ? f.params.expert_grads() : f.params.dense_grads()).host();
            for (int64_t i = v.offset; i < v.offset + v.stored; ++i)
              g[size_t(i)] += grad_value(r, i, v.expert) * float(mb + 1);
          }
          for (int k = 0; k < 5; ++k) sync.poll();
          sync.grads_final(layer);
        }
        if (mb + 1 < kMicro) sync.micro_batch_done();
        else sync.finish();
      }
      int64_t held = 0, total = 0;
      for (const bool expert : {false, true}) {
        const auto& buf = expert ? f.params.expert_grads() : f.params.dense_grads();
        const auto g = buf.host();
        const Range own = f.sharding->shard(expert);
        const int64_t n = expert ? f.params.expert_numel() : f.params.dense_numel();
        int64_t bad_sum = 0, bad_zero = 0;
        for (int64_t i = 0; i < n; ++i) {
          if (i >= own.begin && i < own.end) {
            float want = 0;
            for (int q : f.members(expert))
              for (int mb = 0; mb < kMicro; ++mb) want += grad_value(q, i, expert) * float(mb + 1);
            bad_sum += g[size_t(i)] != want;
          } else {
            bad_zero += g[size_t(i)] != 0.0f;
          }
        }
        EXPECT_EQ(bad_sum, 0) << what << (expert ? ", expert" : ", dense");
        EXPECT_EQ(bad_zero, 0) << what << (expert ? ", expert" : ", dense");
        held += buf.resident_bytes(), total += 4 * buf.size();
      }
      // (the loop above read every page, and reading a hole of shared memory can fault in a page:
      // give the rest back as the next step's start does, then count)
      sync.zero_grads();
      held = f.params.dense_grads().resident_bytes() + f.params.expert_grads().resident_bytes();
      EXPECT_LE(held, total / world_size() + (1 << 20)) << what;
      EXPECT_LT(sync.grad_bytes_high_water(), total) << what;
      EXPECT_GE(sync.grad_bytes_high_water(), total / world_size()) << what;
    }
  }
}

}  // namespace
}  // namespace dstrain::parallel
