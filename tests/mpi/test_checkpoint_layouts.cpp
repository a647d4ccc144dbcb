// Checkpoints across layouts, under mpirun -np 4: every rank initialises its shards of the
// `tiny` model with 4 layers (layout-invariant values) and moments derived from them, rank 0 gathers and
// writes one checkpoint, and the file must hold exactly the single-rank tensors. Then every
// rank of another layout reads back only its own slices and must get its values.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>

#include <cstdio>
#include <filesystem>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/rank_engine.h"

#include "tests/mpi/mpi_test_util.h"

namespace dstrain {
namespace {

using testing::world_rank;

plan::ParallelPlan make(int tp, int pp, int ep, int world, const std::string& dir, int zero = 0) {
  const auto cfg = config::load_config_file(
      "configs/tiny.yaml", {"model.num_hidden_layers=4", "parallel.tensor=" + std::to_string(tp), "parallel.pipeline=" + std::to_string(pp),
                             "parallel.expert=" + std::to_string(ep), "checkpoint.dir=" + dir,
                             "train_batch_size=16", "train_micro_batch_size_per_gpu=null",
                             "gradient_accumulation_steps=null", "zero_optimization.stage=" + std::to_string(zero)});
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
  s.params = std::make_unique<model::ParamStore>(p.params, p.param_stage, p.config.model.num_routed(),
                                                  model::ShardCoords{c.pp, c.tp, p.degrees.tp, c.ep, p.degrees.ep});
  s.be = kernels::make_cpu_backend(1);
  s.adam = std::make_unique<runtime::AdamW>(p.config.optimizer, *s.params, *s.be);
  if (fill) {
    s.params->initialize(1234, 0.02);
    for (auto [w, m, v] : {std::tuple{&s.params->dense_params(), &s.adam->exp_avg_dense(), &s.adam->exp_avg_sq_dense()},
                           std::tuple{&s.params->expert_params(), &s.adam->exp_avg_expert(), &s.adam->exp_avg_sq_expert()}})
      for (size_t i = 0; i < size_t(w->size()); ++i) m->host()[i] = 2 * w->host()[i], v->host()[i] = 3 * w->host()[i];
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
  runtime::Checkpointer ck(saver, comm::ProcessGroup::world());
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
  runtime::Checkpointer ck2(loader, comm::ProcessGroup::world());
  EXPECT_EQ(ck2.load(path, *got.params, got.adam.get()).step, 5);
  EXPECT_EQ(got.params->dense_params().to_host(), expected.params->dense_params().to_host());
  EXPECT_EQ(got.params->expert_params().to_host(), expected.params->expert_params().to_host());
  EXPECT_EQ(got.adam->exp_avg_sq_dense().to_host(), expected.adam->exp_avg_sq_dense().to_host());
  EXPECT_EQ(got.adam->exp_avg_expert().to_host(), expected.adam->exp_avg_expert().to_host());
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointLayouts,
    ::testing::Values(std::pair{Layout{2, 2, 1}, Layout{1, 1, 4}},   // TP2 x PP2  -> DP4 with EP4
                      std::pair{Layout{1, 2, 2}, Layout{2, 1, 2}},   // PP2 x DP2 (EP2) -> TP2 x DP2 (EP2)
                      std::pair{Layout{4, 1, 1}, Layout{1, 4, 1}},   // TP4 -> PP4
                      std::pair{Layout{1, 1, 1}, Layout{2, 2, 1}})); // DP4 -> TP2 x PP2

// A value changed behind HDF5's back (its chunk's Fletcher-32 valid) in the part of a tensor
// that only the second tensor-parallel rank of each pair reads: the ranks that read it see a
// mismatch of the summed partial checksums, and every rank — those that read nothing wrong too
// — refuses the load with the same one-line error naming the file and the tensor.
TEST(CheckpointDamage, ARankOnlyThePeerReadsWrongRefusesOnEveryRank) {
  const std::string dir = ::testing::TempDir() + "/mpi_ckpt_damage";
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const plan::ParallelPlan saver = make(1, 1, 1, 4, dir);
  RankState s = rank_state(saver, true);
  runtime::Checkpointer ck(saver, comm::ProcessGroup::world());
  runtime::TrainState st;
  st.step = 2;
  const std::string path = ck.save(st, *s.params, *s.adam);
  const std::string ds = "model/model.layers.1.self_attn.o_proj.weight";  // row-parallel: columns split over TP
  if (world_rank() == 0) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    const hid_t d = H5Dopen2(f, ds.c_str(), H5P_DEFAULT);
    const hid_t space = H5Dget_space(d);
    hsize_t dims[2];
    H5Sget_simple_extent_dims(space, dims, nullptr);
    const hsize_t at[2] = {1, dims[1] - 1}, one[2] = {1, 1};  // the last column: the second TP rank's
    H5Sselect_hyperslab(space, H5S_SELECT_SET, at, nullptr, one, nullptr);
    const hid_t mem = H5Screate_simple(2, one, nullptr);
    const float x = 0.5f;
    ASSERT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, mem, space, H5P_DEFAULT, &x), 0);
    H5Sclose(mem);
    H5Sclose(space);
    H5Dclose(d);
    H5Fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const plan::ParallelPlan loader = make(2, 1, 1, 4, dir);
  RankState got = rank_state(loader, false);
  runtime::Checkpointer ck2(loader, comm::ProcessGroup::world());
  std::string error;
  try {
    ck2.load(path, *got.params, got.adam.get());
  } catch (const ConfigError& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "checkpoint " + path + ": tensor '" + ds + "' does not match its checksum (a damaged checkpoint)");
  MPI_Barrier(MPI_COMM_WORLD);
}

// ZeRO-1 on layouts with expert parallelism and model parallelism: the dense moments are
// sharded over each data-parallel group, the expert moments over each expert-data-parallel
// group, and the checkpoint gathers each tensor's moments inside that group before rank 0
// assembles the tensor. The file must hold the single-rank tensors; loading it back into the
// same sharded layout must give every rank its own shard.
class ZeroCheckpoint : public ::testing::TestWithParam<Layout> {};

struct ShardedState {
  std::vector<comm::ProcessGroup> groups;
  std::unique_ptr<comm::Communicator> dp, edp;
  std::unique_ptr<parallel::ZeroSharding> zero;
  std::unique_ptr<model::ParamStore> params;
  std::unique_ptr<kernels::Backend> be;
  std::unique_ptr<runtime::AdamW> adam;
};

// This rank's shards of the ZeRO-1 state: exp_avg = 2 p, exp_avg_sq = 3 p over its partitions.
ShardedState sharded_state(const plan::ParallelPlan& p, bool fill) {
  const plan::Coord c = p.grid.coord(world_rank());
  ShardedState s;
  s.groups = comm::create_groups(runtime::group_specs(p.grid, world_rank()));
  s.dp = s.groups[1].communicator("dp");
  s.edp = s.groups[4].communicator("edp");
  s.params = std::make_unique<model::ParamStore>(p.params, p.param_stage, p.config.model.num_routed(),
                                                  model::ShardCoords{c.pp, c.tp, p.degrees.tp, c.ep, p.degrees.ep});
  s.zero = std::make_unique<parallel::ZeroSharding>(1, s.params->dense_numel(), s.params->expert_numel(), *s.dp, *s.edp);
  s.params->pad(s.zero->buffer_length(false), s.zero->buffer_length(true));
  s.be = kernels::make_cpu_backend(1);
  s.adam = std::make_unique<runtime::AdamW>(p.config.optimizer, *s.params, *s.be, s.zero->shard(false),
                                            s.zero->shard(true));
  if (fill) {
    s.params->initialize(1234, 0.02);
    for (const bool e : {false, true}) {
      const auto& w = e ? s.params->expert_params() : s.params->dense_params();
      const parallel::Range sh = s.zero->shard(e);
      for (int64_t i = 0; i < sh.size(); ++i)
        s.adam->moment(1, e).host()[size_t(i)] = 2 * w.host()[size_t(sh.begin + i)],
            s.adam->moment(2, e).host()[size_t(i)] = 3 * w.host()[size_t(sh.begin + i)];
    }
  }
  return s;
}

TEST_P(ZeroCheckpoint, ShardedMomentsAreGatheredOverTheirOwnGroups) {
  const Layout l = GetParam();
  const std::string dir = ::testing::TempDir() + "/mpi_ckpt_zero";
  if (world_rank() == 0) std::filesystem::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const plan::ParallelPlan p = make(l.tp, l.pp, l.ep, 4, dir, 1);
  ShardedState s = sharded_state(p, true);
  EXPECT_EQ(s.zero->group(false).size(), p.degrees.dp);
  EXPECT_EQ(s.zero->group(true).size(), p.degrees.edp_group());  // experts: every (edp, tp)
  runtime::Checkpointer ck(p, comm::ProcessGroup::world());
  runtime::TrainState st;
  st.step = 3;
  const std::string path = ck.save(st, *s.params, *s.adam, s.zero.get());
  if (world_rank() == 0) {
    const plan::ParallelPlan one = make(1, 1, 1, 1, dir);
    model::ParamStore full(one.params, one.param_stage, 32, {});
    full.initialize(1234, 0.02);
    io::H5File f(path, io::H5File::Mode::kRead);
    for (const std::string& name : full.names()) {
      if (full.view(name).buffer) continue;
      std::vector<float> want(full.view(name).info->numel());
      full.store_full(name, want.data());
      for (float& x : want) x *= 3;
      ASSERT_EQ(f.read_floats("optimizer/exp_avg_sq/" + name), want) << name;
    }
  }
  ShardedState expected = sharded_state(p, true), got = sharded_state(p, false);
  runtime::Checkpointer ck2(p, comm::ProcessGroup::world());
  ck2.load(path, *got.params, got.adam.get());
  for (const bool e : {false, true}) {
    EXPECT_EQ(got.adam->moment(1, e).to_host(), expected.adam->moment(1, e).to_host()) << (e ? "expert" : "dense");
    EXPECT_EQ(got.adam->moment(2, e).to_host(), expected.adam->moment(2, e).to_host()) << (e ? "expert" : "dense");
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ZeroCheckpoint,
                         ::testing::Values(Layout{1, 1, 1},    // DP4: one group of four for both buffers
                                           Layout{1, 1, 2},    // DP4 x EP2: experts over pairs
                                           Layout{1, 1, 4},    // DP4 x EP4: experts not sharded at all
                                           Layout{2, 1, 1},    // TP2 x DP2: two dp groups, different shards
                                           Layout{1, 2, 2}));  // PP2 x DP2 x EP2

}  // namespace
}  // namespace dstrain
