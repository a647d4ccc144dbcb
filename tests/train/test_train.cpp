// Training: schedules against DeepSpeed's formulas, AdamW with its decay mask, clipping,
// gradient accumulation, the rank-independent sample order, the loss falling, metrics files.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "engine/config/load_config.h"
#include "engine/runtime/generate.h"
#include "engine/config/presets.h"
#include "engine/data/token_dataset.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/lr_schedule.h"
#include "engine/runtime/metrics.h"
#include "engine/parallel/zero/zero_sharding.h"
#include "engine/runtime/optimizer.h"
#include "engine/runtime/trainer.h"
#include "tests/unit/test_helpers.h"

namespace dstrain::runtime {
namespace {

// The tiny preset, checkpointing into a directory of this test's own (the tests run in parallel
// processes, and a checkpoint directory admits one run at a time); `sets` may override it.
config::TrainConfig tiny(const std::vector<std::string>& sets = {}) {
  std::vector<std::string> all = {"checkpoint.dir=" + ::testing::TempDir() + "/train_" +
                                  ::testing::UnitTest::GetInstance()->current_test_info()->name()};
  all.insert(all.end(), sets.begin(), sets.end());
  return config::load_config_file("configs/tiny.yaml", all);
}

// DeepSpeed's formulas, written out independently (lr_schedules.py).
double ds_warmup(int64_t t, int64_t W, const std::string& type) {
  W = std::max<int64_t>(2, W);
  return type == "log" ? std::log(double(t + 1)) / std::log(double(W)) : double(t) / double(W);
}

TEST(LrSchedule, WarmupLR) {
  for (const char* type : {"log", "linear"}) {
    const auto cfg = tiny({"scheduler.type=WarmupLR", "scheduler.params={warmup_min_lr: 0.0001, "
                           "warmup_max_lr: 0.01, warmup_num_steps: 10, warmup_type: " + std::string(type) + "}"});
    const LrSchedule s(cfg);
    for (int64_t t : {0, 1, 5, 9, 10, 11, 500}) {
      const double gamma = t < 10 ? ds_warmup(t, 10, type) : 1.0;
      EXPECT_NEAR(s.lr(t), 0.0001 + (0.01 - 0.0001) * gamma, 1e-12) << type << " t " << t;
    }
  }
}

TEST(LrSchedule, WarmupDecayLR) {
  const auto cfg = tiny({"scheduler.type=WarmupDecayLR", "scheduler.params={warmup_min_lr: 0.0, "
                         "warmup_max_lr: 0.002, warmup_num_steps: 20, warmup_type: linear, total_num_steps: 100}"});
  const LrSchedule s(cfg);
  for (int64_t t : {0, 10, 19, 20, 21, 60, 99, 100, 150}) {
    const double gamma = t < 20 ? double(t) / 20.0 : std::max(0.0, double(100 - t) / 80.0);
    EXPECT_NEAR(s.lr(t), 0.002 * gamma, 1e-12) << "t " << t;
  }
}

TEST(LrSchedule, WarmupCosineLR) {
  const auto cfg = tiny({"optimizer.params.lr=0.003", "scheduler.type=WarmupCosineLR",
                         "scheduler.params={warmup_min_ratio: 0.1, warmup_num_steps: 10, "
                         "warmup_type: log, cos_min_ratio: 0.05, total_num_steps: 110}"});
  const LrSchedule s(cfg);
  for (int64_t t : {0, 3, 9, 10, 50, 109, 110, 200}) {
    double ratio;
    if (t < 10) {
      ratio = 0.1 + 0.9 * ds_warmup(t, 10, "log");
    } else {
      const double c = (1 + std::cos(M_PI * double(t - 10 + 1) / 100.0)) / 2;
      ratio = std::max(0.0, 0.05 + 0.95 * c);
    }
    EXPECT_NEAR(s.lr(t), 0.003 * ratio, 1e-12) << "t " << t;
  }
  // total_num_steps defaults to train_steps.
  const auto dflt = tiny({"train_steps=77", "scheduler.type=WarmupCosineLR"});
  EXPECT_EQ(*dflt.scheduler->params.total_num_steps, 77);
}

TEST(LrSchedule, ConstantWithoutScheduler) {
  const auto cfg = tiny({"scheduler=null", "optimizer.params.lr=0.0042"});
  const LrSchedule s(cfg);
  EXPECT_EQ(s.lr(0), 0.0042);
  EXPECT_EQ(s.lr(1000), 0.0042);
}

plan::ParallelPlan tiny_plan(const std::vector<std::string>& sets = {}) {
  return plan::make_plan(tiny(sets), 1);
}

// One AdamW step by hand: matrices decay, norm weights do not.
TEST(Optimizer, AdamWDecaysOnlyMatrices) {
  const plan::ParallelPlan p = tiny_plan({"optimizer.params={lr: 0.01, betas: [0.9, 0.99], eps: 1e-8, weight_decay: 0.5}"});
  model::ParamStore params(p.params, p.param_stage, 4, {});
  params.initialize(3, 0.02);
  auto be = kernels::make_cpu_backend(1);
  AdamW adam(p.config.optimizer, params, *be);
  std::fill(params.dense_grads().host().begin(), params.dense_grads().host().end(), 0.2f);
  std::fill(params.expert_grads().host().begin(), params.expert_grads().host().end(), 0.2f);
  const float w0 = params.param("lm_head.weight")[5], n0 = params.param("model.norm.weight")[5];
  const float e0 = params.param("model.layers.1.mlp.experts.2.up_proj.weight")[7];
  adam.step(0.01, 1);
  // Step 1: m = 0.1 g, v = 0.01 g^2; bias-corrected m/sqrt(v) = sign(g) = 1.
  const double update = 0.01 * 1.0 / (1.0 + 1e-8 / 0.2);
  EXPECT_NEAR(params.param("lm_head.weight")[5], w0 * (1 - 0.01 * 0.5) - update, 1e-7);
  EXPECT_NEAR(params.param("model.norm.weight")[5], n0 - update, 1e-7);
  EXPECT_NEAR(params.param("model.layers.1.mlp.experts.2.up_proj.weight")[7], e0 * (1 - 0.005) - update, 1e-7);
  EXPECT_NEAR(adam.exp_avg_dense().host()[0], 0.02, 1e-8);
  EXPECT_NEAR(adam.exp_avg_sq_dense().host()[0], 0.0004, 1e-9);
}

// ZeRO-1/2: a rank's optimizer state is the unsharded state / DP, up to the padding.
TEST(Optimizer, ZeroShardsHoldOneDataParallelShareOfTheState) {
  const plan::ParallelPlan p = tiny_plan();
  model::ParamStore params(p.params, p.param_stage, 4, {});
  auto be = kernels::make_cpu_backend(1);
  const int64_t dense = params.dense_numel(), expert = params.expert_numel();
  for (int dp : {2, 4, 8}) {
    int64_t total = 0;
    const parallel::FlatPartition pd(dense, dp, parallel::kZeroAlign), pe(expert, dp, parallel::kZeroAlign);
    for (int r = 0; r < dp; ++r) {
      AdamW adam(p.config.optimizer, params, *be, pd.part(r), pe.part(r));
      const int64_t state = int64_t(adam.exp_avg_dense().size() + adam.exp_avg_expert().size());
      EXPECT_EQ(int64_t(adam.exp_avg_sq_dense().size() + adam.exp_avg_sq_expert().size()), state);
      EXPECT_LE(std::abs(double(state) - double(dense + expert) / dp), 2 * 16.0) << "dp " << dp;
      total += state;
    }
    EXPECT_GE(total, dense + expert);
    EXPECT_LT(total - (dense + expert), 2 * dp * 16);  // padding below one block per rank and buffer
  }
}

TEST(Optimizer, GradientSquareSumAndClipFactor) {
  const plan::ParallelPlan p = tiny_plan();
  model::ParamStore params(p.params, p.param_stage, 4, {});
  std::fill(params.dense_grads().host().begin(), params.dense_grads().host().end(), 0.5f);
  std::fill(params.expert_grads().host().begin(), params.expert_grads().host().end(), -1.0f);
  const int64_t nd = params.dense_numel(), ne = params.expert_numel();
  auto be = kernels::make_cpu_backend(1);
  EXPECT_NEAR(gradient_square_sum(*be, params, {0, nd}, {0, ne}), 0.25 * double(nd) + double(ne), 1e-9);
  EXPECT_NEAR(gradient_square_sum(*be, params, {10, 20}, {0, 0}), 2.5, 1e-12);  // ranges of the buffers only
  const double norm = 5.0;
  EXPECT_EQ(clip_factor(norm, 2 * norm), 1.0);  // under the limit: untouched
  EXPECT_NEAR(clip_factor(norm, 1.0), 1.0 / (norm + 1e-6), 1e-12);  // DeepSpeed: max / (norm + 1e-6)
  EXPECT_EQ(clip_factor(norm, 0.0), 1.0);  // gradient_clipping 0: off
}

// DeepSpeed's Adam with adam_w_mode false: L2 regularisation joins the gradient before the
// moments (and no decoupled decay) — one step by hand.
TEST(Optimizer, AdamWithoutAdamWModeIsL2Regularised) {
  const plan::ParallelPlan p = tiny_plan({"optimizer.type=Adam", "optimizer.params={lr: 0.01, betas: [0.9, 0.99], "
                                          "eps: 1e-8, weight_decay: 0.5, adam_w_mode: false}"});
  model::ParamStore params(p.params, p.param_stage, 4, {});
  params.initialize(3, 0.02);
  auto be = kernels::make_cpu_backend(1);
  AdamW adam(p.config.optimizer, params, *be);
  std::fill(params.dense_grads().host().begin(), params.dense_grads().host().end(), 0.2f);
  std::fill(params.expert_grads().host().begin(), params.expert_grads().host().end(), 0.2f);
  const float w0 = params.param("lm_head.weight")[5], n0 = params.param("model.norm.weight")[5];
  adam.step(0.01, 1);
  const double g = 0.2 + 0.5 * double(w0);  // the matrix's gradient with the L2 term
  const double m = 0.1 * g, v = 0.01 * g * g;
  EXPECT_NEAR(params.param("lm_head.weight")[5], w0 - 0.01 * (m / 0.1) / (std::sqrt(v / 0.01) + 1e-8), 1e-7);
  EXPECT_NEAR(params.param("model.norm.weight")[5], n0 - 0.01 / (1.0 + 1e-8 / 0.2), 1e-7);  // no decay on norms
  const model::ParamView& lm = params.view("lm_head.weight");
  EXPECT_NEAR(adam.exp_avg_dense().host()[size_t(lm.offset + 5)], m, 1e-8);
}

// Same global batch of 8: one micro-batch of 8, or 4 micro-batches of 2 — same gradients.
TEST(Trainer, GradientAccumulationMatchesOneBigBatch) {
  const std::string dir = ::testing::TempDir() + "/accumulation";
  const plan::ParallelPlan one = tiny_plan({"train_micro_batch_size_per_gpu=8", "gradient_accumulation_steps=1",
                                            "checkpoint.dir=" + dir + "/one"});
  const plan::ParallelPlan four = tiny_plan({"train_micro_batch_size_per_gpu=2", "gradient_accumulation_steps=4",
                                             "checkpoint.dir=" + dir + "/four"});
  ASSERT_EQ(one.batch.global, 8);
  ASSERT_EQ(four.batch.accumulation, 4);
  Trainer a(one, 2), b(four, 2);
  const StepResult ra = a.compute_gradients(3), rb = b.compute_gradients(3);
  EXPECT_NEAR(ra.loss.ce, rb.loss.ce, 1e-6 * ra.loss.ce);
  EXPECT_NEAR(ra.loss.aux, rb.loss.aux, 1e-6 * ra.loss.aux);
  for (auto pick : {&model::ParamStore::dense_grads, &model::ParamStore::expert_grads}) {
    const auto ga = (a.params().*pick)().host();
    const auto gb = (b.params().*pick)().host();
    ASSERT_EQ(ga.size(), gb.size());
    double scale = 0, worst = 0;
    for (size_t i = 0; i < ga.size(); ++i) scale = std::max(scale, double(std::fabs(ga[i])));
    for (size_t i = 0; i < ga.size(); ++i) worst = std::max(worst, double(std::fabs(ga[i] - gb[i])));
    EXPECT_LT(worst / scale, 1e-5);
  }
  EXPECT_EQ(ra.expert_loads, rb.expert_loads);
}

// The samples of a step do not depend on how many data-parallel slices share it.
TEST(Data, SampleOrderIsTheSameFor1And2And4DataParallelSlices) {
  const data::TokenDataset ds(tiny());
  const int64_t G = 16;
  for (int64_t step : {0, 7, 1234}) {
    std::vector<int64_t> single;
    for (int64_t i = 0; i < G; ++i) single.push_back(ds.train_sample_at(data::TokenDataset::position(step, G, 0, 1, 0, G) + i));
    for (int64_t dp : {2, 4}) {
      const int64_t micro = 2, accum = G / dp / micro;
      std::vector<int64_t> joined;
      for (int64_t r = 0; r < dp; ++r)
        for (int64_t m = 0; m < accum; ++m)
          for (int64_t j = 0; j < micro; ++j)
            joined.push_back(ds.train_sample_at(data::TokenDataset::position(step, G, r, dp, m, micro) + j));
      EXPECT_EQ(joined, single) << "dp " << dp << " step " << step;
    }
  }
}

// A blend too: each data-parallel rank, with its own dataset object reading only its slices, and
// a run resumed mid-epoch at step 1,234 (a fresh object starting there), see the samples one rank
// reading every position in order sees — dataset and sample.
TEST(Data, BlendOrderIsTheSameFor1And2And4DataParallelSlicesAndOnResume) {
  const std::string dir = ::testing::TempDir();
  std::vector<int32_t> a(30000), b(9000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = int32_t(i % 256);
  for (size_t i = 0; i < b.size(); ++i) b[i] = int32_t((i * 7) % 256);
  data::write_token_dataset(dir + "/order_a.h5", a, 256, "bytes", "", "a");
  data::write_token_dataset(dir + "/order_b.h5", b, 256, "bytes", "", "b");
  const config::TrainConfig cfg =
      tiny({"data.paths=[2, " + dir + "/order_a.h5, 1, " + dir + "/order_b.h5]"});
  const int64_t G = 16;
  const data::TokenDataset one(cfg);
  for (int64_t step : {0, 7, 1234}) {
    std::vector<std::pair<int, int64_t>> single;
    for (int64_t i = 0; i < G; ++i) single.push_back(one.train_sample(data::TokenDataset::position(step, G, 0, 1, 0, G) + i));
    const data::TokenDataset resumed(cfg);  // a fresh walk from this step
    std::vector<std::pair<int, int64_t>> again;
    for (int64_t i = 0; i < G; ++i) again.push_back(resumed.train_sample(data::TokenDataset::position(step, G, 0, 1, 0, G) + i));
    EXPECT_EQ(again, single) << "resumed at step " << step;
    for (int64_t dp : {2, 4}) {
      const int64_t micro = 2, accum = G / dp / micro;
      std::vector<std::pair<int, int64_t>> joined;
      for (int64_t r = 0; r < dp; ++r) {
        const data::TokenDataset rank(cfg);  // each rank its own
        for (int64_t m = 0; m < accum; ++m)
          for (int64_t j = 0; j < micro; ++j)
            joined.push_back(rank.train_sample(data::TokenDataset::position(step, G, r, dp, m, micro) + j));
      }
      EXPECT_EQ(joined, single) << "dp " << dp << " step " << step;
    }
  }
}

TEST(Data, EachEpochVisitsEverySampleOnceInASeededOrder) {
  const data::TokenDataset ds(tiny());
  const int64_t n = ds.info().train_samples;
  std::set<int64_t> seen;
  std::vector<int64_t> first_epoch, second_epoch;
  for (int64_t g = 0; g < n; ++g) first_epoch.push_back(ds.train_sample_at(g));
  for (int64_t g = n; g < 2 * n; ++g) second_epoch.push_back(ds.train_sample_at(g));
  seen.insert(first_epoch.begin(), first_epoch.end());
  EXPECT_EQ(int64_t(seen.size()), n);
  EXPECT_NE(first_epoch, second_epoch);
  const data::TokenDataset other(tiny({"seed=99"}));
  std::vector<int64_t> other_first;
  for (int64_t g = 0; g < 10; ++g) other_first.push_back(other.train_sample_at(g));
  EXPECT_NE(other_first, std::vector<int64_t>(first_epoch.begin(), first_epoch.begin() + 10));
}

TEST(Trainer, TinyLossFallsOver50Steps) {
  const plan::ParallelPlan p = tiny_plan({"train_steps=50"});
  Trainer t(p, 2);
  double first = 0, last = 0;
  for (int64_t step = 0; step < 50; ++step) {
    const StepResult r = t.train_step(step);
    ASSERT_TRUE(std::isfinite(r.loss.ce));
    if (step == 0) first = r.loss.ce;
    if (step >= 45) last += r.loss.ce / 5;
  }
  EXPECT_NEAR(first, std::log(256.0), 0.1);
  EXPECT_LT(last, first - 1.5) << "first " << first << " last five " << last;
  EXPECT_LT(t.validate(), first - 1.5);
}

TEST(Trainer, RunWritesMetricsAndTensorBoard) {
  const std::string dir = ::testing::TempDir() + "/run_metrics";
  std::filesystem::remove_all(dir);
  const plan::ParallelPlan p = tiny_plan({"train_steps=6", "steps_per_print=2", "data.eval_interval=3",
                                          "monitor.metrics_file=" + dir + "/m.jsonl",
                                          "monitor.tensorboard=" + dir + "/tb", "wall_clock_breakdown=true",
                                          "checkpoint.dir=" + dir + "/ckpt", "checkpoint.resume=none"});
  Trainer t(p, 1);
  const TrainSummary s = t.run();
  EXPECT_EQ(s.steps, 6);
  std::ifstream in(dir + "/m.jsonl");
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 4u);  // steps 2, 4, 6 (steps_per_print) and 3 (validation, logged too)
  std::vector<nlohmann::json> rows;
  for (const std::string& l : lines) rows.push_back(nlohmann::json::parse(l));  // each line one JSON object
  EXPECT_EQ(rows[0]["step"], 2);
  for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu", "forward_ms"})
    EXPECT_TRUE(rows[0].contains(key) && rows[0][key].is_number()) << key << " in " << lines[0];
  EXPECT_FALSE(rows[0].contains("val_loss"));
  EXPECT_EQ(rows[1]["step"], 3);
  EXPECT_TRUE(rows[1].contains("val_loss"));
  EXPECT_TRUE(rows[3].contains("val_loss"));
  std::string event_file;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/tb")) event_file = e.path().string();
  const auto events = read_tensorboard_scalars(event_file);
  int losses = 0;
  for (const auto& e : events) losses += e.tag == "loss";
  EXPECT_EQ(losses, 4);
  EXPECT_EQ(events.front().step, 2);
}

TEST(Metrics, Crc32cKnownAnswerAndEventRoundTrip) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  const std::string dir = ::testing::TempDir() + "/tb_roundtrip";
  std::filesystem::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter w(dir);
    w.write(7, {{"loss", 2.5}, {"lr", 1e-3}});
    path = w.path();
  }
  const auto ev = read_tensorboard_scalars(path);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].step, 7);
  EXPECT_EQ(ev[0].tag, "loss");
  EXPECT_EQ(ev[0].value, 2.5f);
  EXPECT_EQ(ev[1].value, 1e-3f);
  // A flipped byte is caught by the CRC.
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(-6, std::ios::end);
  f.put('\x7f');
  f.close();
  EXPECT_THROW(read_tensorboard_scalars(path), Error);
}

}  // namespace
}  // namespace dstrain::runtime

namespace dstrain::runtime {
namespace {

// JSON written by dstrain escapes what it must: quotes, backslashes and non-ASCII in
// model.architectures (the HF config.json, also stored in every checkpoint) and in the paths of
// the metrics file, which a JSON parser must read back exactly.
TEST(Json, QuotesBackslashesAndNonAsciiSurviveConfigAndMetrics) {
  const std::string arch = "Deepseek\"V3\\For\tCausalLM \xc3\xbc\xe2\x82\xac";  // ", \, tab, ü, €
  config::ModelConfig m = config::model_preset("tiny");
  m.architectures = {arch, "second"};
  const nlohmann::json hf = nlohmann::json::parse(config::to_hf_config_json(m));
  EXPECT_EQ(hf["architectures"], nlohmann::json::array({arch, "second"}));
  EXPECT_EQ(hf["rope_scaling"], nullptr);
  EXPECT_EQ(hf["vocab_size"], 256);

  const std::string dir = ::testing::TempDir() + "/json \"odd\" \\ dir \xc3\xa9";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string metrics = dir + "/m\"etrics\\ \xc3\xbc.jsonl";
  plan::ParallelPlan p = tiny_plan({"train_steps=2", "steps_per_print=1", "data.eval_interval=0",
                                    "checkpoint.resume=none", "checkpoint.dir=" + dir + "/ckpt"});
  p.config.monitor.metrics_file = metrics;  // set directly: any bytes a file system allows
  p.config.model.architectures = {arch};
  Trainer t(p, 1);
  t.run();
  std::ifstream in(metrics);
  int rows = 0;
  for (std::string line; std::getline(in, line); ++rows) EXPECT_TRUE(nlohmann::json::parse(line).contains("loss"));
  EXPECT_EQ(rows, 2);
  const io::H5File ckpt(latest_checkpoint(dir + "/ckpt"), io::H5File::Mode::kRead);
  EXPECT_EQ(nlohmann::json::parse(ckpt.attr_string("hf_config"))["architectures"][0], arch);
}

}  // namespace
// dstrain generate's choice of the next token: greedy is the argmax (lowest id on a tie);
// sampling draws from softmax(logits / T) over the top k — the uniform draw walks the
// cumulative probabilities in descending order — and never returns a token outside the top k or
// past the vocabulary bound.
TEST(Generate, PickTokenGreedyTopKAndTemperature) {
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, 0.0f, 2.0f, 9.0f};  // id 5 is past the vocabulary of 5
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 0.0, 0, 0.99), 1);  // greedy: the first of the tied best
  EXPECT_EQ(runtime::pick_token(logits.data(), 6, 0.0, 0, 0.5), 5);
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 1.0, 1, 0.99), 1);  // top-k 1 is greedy
  // Top 3 at T = 1: ids 1, 2 (e^3 each) and 4 (e^2): probabilities 0.422, 0.422, 0.155.
  const double e3 = std::exp(3.0), e2 = std::exp(2.0), z = 2 * e3 + e2;
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 1.0, 3, 0.0), 1);
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 1.0, 3, e3 / z - 1e-6), 1);
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 1.0, 3, e3 / z + 1e-6), 2);
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 1.0, 3, 2 * e3 / z + 1e-6), 4);
  EXPECT_EQ(runtime::pick_token(logits.data(), 5, 1.0, 3, 0.999999), 4);
  // The empirical distribution over many draws matches softmax(logits / T), top k = all.
  const double T = 2.0;
  std::vector<double> want(5), got(5);
  double zt = 0;
  for (int i = 0; i < 5; ++i) zt += want[size_t(i)] = std::exp(double(logits[size_t(i)]) / T);
  const int draws = 20000;
  for (int d = 0; d < draws; ++d) got[size_t(runtime::pick_token(logits.data(), 5, T, 0, (d + 0.5) / draws))] += 1.0 / draws;
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(got[size_t(i)], want[size_t(i)] / zt, 1e-3) << i;
}

}  // namespace dstrain::runtime
