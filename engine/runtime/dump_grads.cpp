#include "engine/runtime/dump_grads.h"

#include <fmt/format.h>

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

void dump_grads(const plan::ParallelPlan& plan, const std::string& path, int threads) {
  const config::TrainConfig& cfg = plan.config;
  if (plan.degrees.world() != 1)
    throw ConfigError(fmt::format("--dump-grads runs on one rank (the layout has {}); run it "
                                  "without mpirun or with -np 1",
                                  plan.degrees.world()));
  const int64_t B = plan.batch.global, S = cfg.seq_length;
  const config::ModelConfig& m = cfg.model;
  // The whole global batch in one forward; no gradient reduction (one rank).
  const RankEngine engine = build_rank_engine(plan, RankGroups(plan), EngineOptions{threads, false, B});
  model::ParamStore& params = *engine.params;
  Checkpointer checkpoints(plan, comm::ProcessGroup::self("world"));  // checkpoint.resume: the model to dump
  checkpoints.resume(params, nullptr);
  model::DeepSeekModel& net = *engine.model;
  const std::vector<int32_t> tokens = first_batch_tokens(cfg, B);
  const model::Losses loss = net.forward(tokens.data(), {double(B * S), double(B)});
  net.backward();

  io::H5File out(path, io::H5File::Mode::kCreate);
  std::vector<float> full;
  for (const std::string& name : params.names()) {
    const model::ParamView& v = params.view(name);
    full.assign(v.info->numel(), 0.0f);
    params.store_full(name, full.data());
    out.write("weights/" + name, full.data(), v.info->shape);
    if (v.buffer) continue;
    params.store_full(name, full.data(), true);
    out.write("grads/" + name, full.data(), v.info->shape);
  }
  out.write("tokens", tokens.data(), {B, S + 1});
  out.set_attr("ce_loss", loss.ce);
  out.set_attr("aux_loss", loss.aux);
  out.set_attr("mtp_loss", loss.mtp);
  out.set_attr("total_loss", loss.total());
  out.set_attr("aux_included", m.aux_loss_alpha > 0 ? 1.0 : 0.0);
  out.set_attr("mtp_included", m.num_nextn_predict_layers > 0 ? 1.0 : 0.0);
  out.set_attr("config", config::to_hf_config_json(m));
  out.set_attr("dstrain_config", config::to_yaml(cfg));
}

}  // namespace dstrain::runtime
