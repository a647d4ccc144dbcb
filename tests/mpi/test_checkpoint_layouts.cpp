// Checkpoints across layouts, under mpirun -np 4: every rank initialises its shards of the
// `small` model (layout-invariant values) and moments derived from them, rank 0 gathers and
// writes one checkpoint, and the file must hold exactly the single-rank tensors. Then every
// rank of another layout reads back only its own slices and must get its values.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <filesystem>

#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"

#include "tests/mpi/mpi_test_util.h"

namespace dstrain {
namespace {

using testing::world_rank;

plan::ParallelPlan make(int tp, int pp, int ep, int world, const std::string& dir) {
  const auto cfg = config::load_config_file(
      "configs/small.yaml", {"parallel.tensor=" + std::to_string(tp), "parallel.pipeline=" + std::to_string(pp),
                             "parallel.expert=" + std::to_string(ep), "checkpoint.dir=" + dir,
                             "train_batch_size=16", "train_micro_batch_size_per_gpu=null",
                             "gradient_accumulation_steps=null"});
  return plan::make_plan(cfg, world);
}

struct RankState {
  std::unique_ptr<model::ParamStore> params;
  std::unique_ptr<kernels::Backend> be;
  std::unique_ptr<runtime::AdamW> adam;
};

// This rank's shards: initialised parameters, exp_avg = 2 p, exp_avg_sq = 3 p.
RankState rank_state(const plan::ParallelPlan& p, bool fill) {
  const plan::Coord c = p.grid.coord(world_rank());
  RankState s;
  s.params = std::make_unique<model::ParamStore>(p.params, p.param_stage, 32,
                                                  model::ShardCoords{c.pp, c.tp, p.degrees.tp, c.ep, p.degrees.ep});
  s.be = kernels::make_cpu_backend(1);
  s.adam = std::make_unique<runtime::AdamW>(p.config.optimizer, *s.params, *s.be);
  if (fill) {
    s.params->initialize(1234, 0.02);
    for (auto [w, m, v] : {std::tuple{&s.params->dense_params(), &s.adam->exp_avg_dense(), &s.adam->exp_avg_sq_dense()},
                           std::tuple{&s.params->expert_params(), &s.adam->exp_avg_expert(), &s.adam->exp_avg_sq_expert()}})
      for (size_t i = 0; i < w->size(); ++i) (*m)[i] = 2 * (*w)[i], (*v)[i] = 3 * (*w)[i];
  }
  return s;
}

struct Layout {
  int tp, pp, ep;
};

class CheckpointLayouts : public ::testing::TestWithParam<std::pair<Layout, Layout>> {};

TEST_P(CheckpointLayouts, SaveOnOneLayoutLoadOnAnother) {
  const auto [save_l, load_l] = GetParam();
  const std::string dir = ::testing::TempDir() + "/mpi_ckpt_layouts";
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const plan::ParallelPlan saver = make(save_l.tp, save_l.pp, save_l.ep, 4, dir);
  RankState s = rank_state(saver, true);
  runtime::Checkpointer ck(saver, MPI_COMM_WORLD);
  runtime::TrainState st;
  st.step = 5;
  const std::string path = ck.save(st, *s.params, *s.adam);

  if (world_rank() == 0) {  // the file holds the single-rank tensors
    const plan::ParallelPlan one = make(1, 1, 1, 1, dir);
    model::ParamStore full(one.params, one.param_stage, 32, {});
    full.initialize(1234, 0.02);
    io::H5File f(path, io::H5File::Mode::kRead);
    for (const std::string& name : full.names()) {
      std::vector<float> want(full.view(name).info->numel());
      full.store_full(name, want.data());
      ASSERT_EQ(f.read_floats("model/" + name), want) << name;
      if (full.view(name).buffer) continue;
      for (float& x : want) x *= 2;
      ASSERT_EQ(f.read_floats("optimizer/exp_avg/" + name), want) << name;
    }
  }
  const plan::ParallelPlan loader = make(load_l.tp, load_l.pp, load_l.ep, 4, dir);
  RankState expected = rank_state(loader, true), got = rank_state(loader, false);
  runtime::Checkpointer ck2(loader, MPI_COMM_WORLD);
  EXPECT_EQ(ck2.load(path, *got.params, got.adam.get()).step, 5);
  EXPECT_EQ(got.params->dense_params(), expected.params->dense_params());
  EXPECT_EQ(got.params->expert_params(), expected.params->expert_params());
  EXPECT_EQ(got.adam->exp_avg_sq_dense(), expected.adam->exp_avg_sq_dense());
  EXPECT_EQ(got.adam->exp_avg_expert(), expected.adam->exp_avg_expert());
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointLayouts,
    ::testing::Values(std::pair{Layout{2, 2, 1}, Layout{1, 1, 4}},   // TP2 x PP2  -> DP4 with EP4
                      std::pair{Layout{1, 2, 2}, Layout{2, 1, 2}},   // PP2 x DP2 (EP2) -> TP2 x DP2 (EP2)
                      std::pair{Layout{4, 1, 1}, Layout{1, 4, 1}},   // TP4 -> PP4
                      std::pair{Layout{1, 1, 1}, Layout{2, 2, 1}})); // DP4 -> TP2 x PP2

}  // namespace
}  // namespace dstrain
