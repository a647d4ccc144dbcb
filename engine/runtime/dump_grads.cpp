#include "engine/runtime/dump_grads.h"

#include <fmt/format.h>

#include <optional>
#include <spdlog/spdlog.h>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/data/token_dataset.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/rank_engine.h"

namespace dstrain::runtime {

std::vector<int32_t> first_batch_tokens(const config::TrainConfig& cfg, int64_t B) {
  const data::TokenDataset dataset(cfg);
  std::vector<int32_t> tokens(B * (cfg.seq_length + 1));
  dataset.train_batch(tokens.data(), 0, B);
  return tokens;
}

// The ranks whose local gradients of parameter i sum to its full gradient: every holder on the
// parameter's stage (data-parallel replicas hold partial sums; tensor-parallel ranks hold their
// shards, or — the routed experts — partial sums over their token parts), except that the
// parameters every tensor-parallel rank holds whole, and computes complete, count once (tp 0).
static bool contributes(const plan::ParallelPlan& p, size_t i, int rank) {
  const plan::Coord c = p.grid.coord(rank);
  if (c.pp != p.param_stage[i] || !p.shard(i, rank).held) return false;
  return p.params[i].shard != plan::Shard::kReplicated || c.tp == 0;
}

void dump_grads(const plan::ParallelPlan& plan, const RankGroups& groups, const std::string& path, int threads) {
  const config::TrainConfig& cfg = plan.config;
  const int64_t B = plan.batch.global, S = cfg.seq_length, dp = plan.degrees.dp;
  const config::ModelConfig& m = cfg.model;
  // The whole global batch in one forward per data-parallel rank (its share); no gradient
  // reduction — the local gradients are summed as they are gathered to rank 0 below.
  // Under pipeline parallelism the schedule runs it, as one micro-batch where the schedule
  // allows (else the plan's micro-batches: the gradient is their sum).
  const bool one = plan::schedule_refusal(cfg.parallel.pipeline_schedule, plan.degrees.pp, 1, plan.chunks()).empty();
  const int64_t micro = one ? B / dp : plan.batch.micro, micros = one ? 1 : plan.batch.accumulation;
  const RankEngine engine = build_rank_engine(plan, groups, EngineOptions{threads, false, micro, true, micros});
  model::ParamStore& params = *engine.params;
  Checkpointer checkpoints(plan, groups.world());  // checkpoint.resume: the model to dump
  const std::optional<Checkpointer::Resumed> resumed = checkpoints.resume(params, nullptr);
  const std::vector<int32_t> tokens = first_batch_tokens(cfg, B);
  const plan::Coord& me = groups.coord();
  const model::Losses local =
      engine.pipeline
          ->run(
              [&](int64_t m, int32_t* out) {
                const int32_t* mine =
                    tokens.data() + data::TokenDataset::position(0, B, me.dp, dp, m, micro) * (S + 1);
                std::copy(mine, mine + micro * (S + 1), out);
              },
              {double(B * S), double(B)}, nullptr, {})
          .loss;

  const auto world = groups.world().communicator("dump", {cfg.parallel.comm_timeout_s});
  const int rank = world->rank();
  // Said aloud: with checkpoint.resume auto a checkpoint left in checkpoint.dir is what is dumped,
  // and two dumps compared across machines then differ by that checkpoint, not by the code.
  if (rank == 0 && resumed)
    spdlog::info("--dump-grads: the weights of {} (step {}; --resume none for the initial weights)", resumed->path,
                 resumed->state.step);
  // The losses are complete on every tensor-parallel rank: sum the data-parallel shares of tp 0.
  std::vector<double> losses = {local.ce, local.aux, local.mtp};
  if (me.tp != 0) losses.assign(3, 0.0);
  world->all_reduce(losses.data(), 3, comm::ReduceOp::kSum)->wait();
  const model::Losses loss{losses[0], losses[1], losses[2]};

  std::optional<io::H5File> out;
  if (rank == 0) out.emplace(path, io::H5File::Mode::kCreate);
  std::vector<float> full, sum, piece;
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const plan::ParamInfo& info = plan.params[i];
    for (const bool grad : {false, true}) {
      if (grad && info.buffer) continue;
      if (rank != 0) {
        if (contributes(plan, i, rank)) {
          const std::vector<float> mine = params.local_values(info.name, grad);
          world->send(mine.data(), int64_t(mine.size()), 0)->wait();
        }
        continue;
      }
      sum.assign(info.numel(), 0.0f);
      full.assign(info.numel(), 0.0f);
      for (int r = 0; r < plan.degrees.world(); ++r) {
        if (!contributes(plan, i, r)) continue;
        model::ParamView v;
        v.info = &info;
        v.shard = plan.shard(i, r);
        piece.resize(v.shard.local_numel());
        if (r == 0) {
          piece = params.local_values(info.name, grad);
        } else {
          world->recv(piece.data(), int64_t(piece.size()), r)->wait();
        }
        if (!grad) {  // weights: the replicas are equal, each slice lands where its shard lies
          model::ParamStore::slice_to_full(v, piece.data(), sum.data());
          continue;
        }
        std::fill(full.begin(), full.end(), 0.0f);
        model::ParamStore::slice_to_full(v, piece.data(), full.data());
        for (size_t j = 0; j < full.size(); ++j) sum[j] += full[j];
      }
      out->write((grad ? "grads/" : "weights/") + info.name, sum.data(), info.shape);
    }
  }
  if (rank != 0) return;
  out->write("tokens", tokens.data(), {B, S + 1});
  out->set_attr("ce_loss", loss.ce);
  out->set_attr("aux_loss", loss.aux);
  out->set_attr("mtp_loss", loss.mtp);
  out->set_attr("total_loss", loss.total());
  out->set_attr("aux_included", m.aux_loss_alpha > 0 ? 1.0 : 0.0);
  out->set_attr("mtp_included", m.num_nextn_predict_layers > 0 ? 1.0 : 0.0);
  out->set_attr("config", config::to_hf_config_json(m));
  out->set_attr("dstrain_config", config::to_yaml(cfg));
  out->set_attr("layout", fmt::format("tensor={} pipeline={} data={} expert={}", plan.degrees.tp, plan.degrees.pp,
                                      plan.degrees.dp, plan.degrees.ep));
}

}  // namespace dstrain::runtime
