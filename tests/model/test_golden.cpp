// The model against Hugging Face (tools/make_golden.py): with the weights and batch stored in
// tests/golden/<variant>.h5, dstrain's logits, losses and every parameter gradient must equal
// the float64 transformers reference — worst error per tensor <= 1e-5 of the tensor's largest
// magnitude. A mismatch names the tensor and its worst element.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "engine/config/load_config.h"
#include "engine/model/deepseek_model.h"
#include "engine/plan/parallel_plan.h"
#include "engine/io/hdf5_file.h"

namespace dstrain {
namespace {

struct Worst {
  double rel = 0, got = 0, want = 0;
  int64_t index = -1;
};

Worst compare(const float* got, const std::vector<float>& want) {
  double scale = 1e-30;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  Worst worst;
  for (size_t i = 0; i < want.size(); ++i) {
    const double rel = std::fabs(double(got[i]) - double(want[i])) / scale;
    if (rel > worst.rel || worst.index < 0) worst = {rel, got[i], want[i], int64_t(i)};
  }
  return worst;
}

constexpr double kTolerance = 1e-5;

class Golden : public ::testing::TestWithParam<std::string> {};

TEST_P(Golden, LogitsLossesAndEveryGradientMatchHuggingFace) {
  const std::string path = "tests/golden/" + GetParam() + ".h5";
  io::H5File f(path, io::H5File::Mode::kRead);
  const config::TrainConfig cfg = config::load_config_text(f.attr_string("dstrain_config"), path);
  const plan::ParallelPlan plan = plan::make_plan(cfg, 1);
  const config::ModelConfig& m = cfg.model;
  model::ParamStore params(plan.params, plan.param_stage, m.num_routed(), model::ShardCoords{});
  for (const std::string& name : params.names()) {
    ASSERT_TRUE(f.exists("weights/" + name)) << name;
    ASSERT_EQ(f.shape("weights/" + name), params.view(name).info->shape) << name;
    params.load_full(name, f.read_floats("weights/" + name).data());
  }
  const std::vector<int32_t> tokens = f.read_ints("tokens");
  const int64_t B = f.shape("tokens")[0], S = f.shape("tokens")[1] - 1;
  auto be = kernels::make_cpu_backend(2);
  model::LocalCollectives coll;
  // The LM head and cross-entropy in one chunk, and in chunks of 5 rows (B * S is not a multiple):
  // the logits of every chunk, the loss and the head's gradients made chunk by chunk all match.
  for (const int64_t chunk : {int64_t(0), int64_t(5)}) {
    SCOPED_TRACE(chunk ? "chunks of 5 rows" : "one chunk");
    model::StageSpec spec;
    spec.loss_chunk_rows = chunk;
    model::DeepSeekModel net(m, *be, coll, params, B, S, false, spec);
    params.zero_grads();
    net.keep_logits(true);
    const model::Losses loss = net.forward(tokens.data(), {double(B * S), double(B)});
    net.backward();

    EXPECT_NEAR(loss.ce, f.attr_double("ce_loss"), kTolerance * f.attr_double("ce_loss"));
    EXPECT_NEAR(loss.aux, f.attr_double("aux_loss"), kTolerance * std::max(1e-3, f.attr_double("aux_loss")));
    EXPECT_NEAR(loss.mtp, f.attr_double("mtp_loss"), kTolerance * std::max(1e-3, f.attr_double("mtp_loss")));
    EXPECT_GT(loss.aux, 0.0);  // the variants train with the balance loss on

    const Worst lw = compare(net.logits().data(), f.read_floats("logits"));
    EXPECT_LE(lw.rel, kTolerance) << "logits: worst element " << lw.index << ": " << lw.got
                                  << " vs " << lw.want;
    int compared = 0;
    for (const std::string& name : params.names()) {
      if (params.view(name).buffer) continue;
      ASSERT_TRUE(f.exists("grads/" + name)) << "golden file has no gradient for " << name;
      const Worst w = compare(params.grad(name), f.read_floats("grads/" + name));
      EXPECT_LE(w.rel, kTolerance) << "grad " << name << ": worst element " << w.index << ": dstrain "
                                   << w.got << " vs Hugging Face " << w.want << " (relative " << w.rel << ")";
      ++compared;
    }
    EXPECT_EQ(compared, int(f.list("grads").size())) << "gradients in the golden file not compared";

    // A forward for the loss only (validation) gives the same losses and adds no gradient: the
    // head, whose backward runs inside forward, skips it.
    params.zero_grads();
    const model::Losses again = net.forward(tokens.data(), {double(B * S), double(B), 1.0, false});
    EXPECT_EQ(again.ce, loss.ce);
    EXPECT_EQ(again.mtp, loss.mtp);
    for (const std::string& name : params.names()) {
      if (params.view(name).buffer) continue;
      const float* g = params.grad(name);
      const int64_t n = params.view(name).numel;
      EXPECT_EQ(std::count(g, g + n, 0.0f), n) << name << " has a gradient after a loss-only forward";
    }
  }
}


// The same batch through two pipeline stages in one process (layer 0 and the embedding on the
// first; layer 1, the head and the MTP module — with its mirror of the embedding — on the last):
// the first stage's output is the last stage's input, the last stage's input gradient the first
// stage's output gradient, the mirror's gradient added to the embedding's, as the pipeline
// runtime does. Run twice: with whole backward passes, and with the weight gradients deferred
// and run afterwards (zero-bubble's B / W split). Losses and every gradient match Hugging Face.
TEST_P(Golden, TwoPipelineStagesMatchHuggingFace) {
  const std::string path = "tests/golden/" + GetParam() + ".h5";
  io::H5File f(path, io::H5File::Mode::kRead);
  config::TrainConfig cfg = config::load_config_text(f.attr_string("dstrain_config"), path);
  cfg.parallel.pipeline = 2;
  const plan::ParallelPlan plan = plan::make_plan(cfg, 2);
  const config::ModelConfig& m = cfg.model;
  ASSERT_EQ(plan.stages.size(), 2u);
  const std::vector<int32_t> tokens = f.read_ints("tokens");
  const int64_t B = f.shape("tokens")[0], S = f.shape("tokens")[1] - 1;
  auto be = kernels::make_cpu_backend(2);
  model::LocalCollectives coll;
  for (const bool split : {false, true}) {
    std::vector<std::unique_ptr<model::ParamStore>> stores;
    for (int s = 0; s < 2; ++s) {
      stores.push_back(std::make_unique<model::ParamStore>(plan.params, plan.param_stage, m.num_routed(),
                                                           model::ShardCoords{s}));
      for (const std::string& name : stores.back()->names())
        stores.back()->load_full(name, f.read_floats("weights/" + name).data());
    }
    const std::string embed = "model.embed_tokens.weight";
    const int64_t n_embed = stores[0]->view(embed).numel;
    std::vector<float> mirror_w(stores[0]->param(embed), stores[0]->param(embed) + n_embed), mirror_g(n_embed, 0.0f);
    std::vector<std::unique_ptr<model::DeepSeekModel>> stage;
    for (int s = 0; s < 2; ++s) {
      const plan::StageRange& r = plan.stages[size_t(s)];
      model::StageSpec spec;
      spec.first_layer = r.first_layer, spec.end_layer = r.end_layer;
      spec.embedding = r.has_embedding, spec.head = r.has_head;
      if (r.has_head && !r.has_embedding) spec.embed_table = kernels::f32(mirror_w.data()), spec.embed_g = mirror_g.data();
      spec.loss_chunk_rows = split ? 7 : 0;  // the split run's head (and MTP head) in chunks of 7 rows
      stage.push_back(std::make_unique<model::DeepSeekModel>(m, *be, coll, *stores[size_t(s)], B, S, false, spec));
    }
    const model::LossScale scale{double(B * S), double(B)};
    const model::Losses first = stage[0]->forward_stage(tokens.data(), nullptr, scale);
    const model::Losses last = stage[1]->forward_stage(tokens.data(), stage[0]->output(), scale);
    model::WeightGradDeferral deferred[2] = {model::WeightGradDeferral(*be), model::WeightGradDeferral(*be)};
    for (int s = 0; s < 2; ++s) stage[size_t(s)]->mark_workspace_volatile(deferred[s]);
    {
      const model::WeightGradDeferral::Scope d(split ? &deferred[1] : nullptr);
      stage[1]->backward_stage(nullptr);
    }
    {
      const model::WeightGradDeferral::Scope d(split ? &deferred[0] : nullptr);
      stage[0]->backward_stage(stage[1]->input_grad());
    }
    EXPECT_EQ(split, !deferred[0].empty() && !deferred[1].empty());
    for (auto& d : deferred) d.run();
    be->add({stores[0]->grad(embed), {n_embed}}, {mirror_g.data(), {n_embed}});

    EXPECT_EQ(first.ce, 0.0);
    EXPECT_NEAR(last.ce, f.attr_double("ce_loss"), kTolerance * f.attr_double("ce_loss"));
    EXPECT_NEAR(first.aux + last.aux, f.attr_double("aux_loss"), kTolerance * std::max(1e-3, f.attr_double("aux_loss")));
    EXPECT_NEAR(last.mtp, f.attr_double("mtp_loss"), kTolerance * std::max(1e-3, f.attr_double("mtp_loss")));
    int compared = 0;
    for (const auto& store : stores)
      for (const std::string& name : store->names()) {
        if (store->view(name).buffer) continue;
        const Worst w = compare(store->grad(name), f.read_floats("grads/" + name));
        EXPECT_LE(w.rel, kTolerance) << (split ? "B/W split: " : "") << "grad " << name << ": worst element "
                                     << w.index << ": " << w.got << " vs " << w.want;
        ++compared;
      }
    EXPECT_EQ(compared, int(f.list("grads").size())) << "gradients in the golden file not compared";
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, Golden, ::testing::Values("tiny_v3", "tiny_v2", "tiny_v3_yarn"));

}  // namespace
}  // namespace dstrain
