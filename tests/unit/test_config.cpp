// The config loader on valid input: defaults, presets, overrides, locations, --print-config.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "engine/config/presets.h"
#include "engine/config/yaml_io.h"
#include "tests/unit/test_helpers.h"

namespace dstrain::config {
namespace {

using dstrain::testing::base_yaml;
using dstrain::testing::load;

TEST(Config, DefaultsFollowDeepSpeed) {
  const TrainConfig c = load(base_yaml());
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);  // dynamic
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_EQ(c.zero_optimization.stage, 0);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.steps_per_print, 10);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_FALSE(c.scheduler.has_value());
  EXPECT_TRUE(c.parallel.data.is_auto());
  EXPECT_EQ(c.precision(), Precision::kFp32);
  EXPECT_EQ(*c.train_batch_size, 8);
  EXPECT_FALSE(c.train_micro_batch_size_per_gpu.has_value());
}

TEST(Config, PresetThenOverridesInTheSameSection) {
  const TrainConfig c = load(
      "train_batch_size: 8\nmodel:\n  preset: small\n  hidden_size: 512\n  q_lora_rank: null\n");
  const ModelConfig small = model_preset("small");
  EXPECT_EQ(c.model.preset, "small");
  EXPECT_EQ(c.model.hidden_size, 512);
  EXPECT_FALSE(c.model.q_lora_rank.has_value());
  EXPECT_EQ(c.model.n_routed_experts, small.n_routed_experts);
  EXPECT_EQ(c.model.kv_lora_rank, small.kv_lora_rank);
  EXPECT_EQ(c.model.bias_update_speed, small.bias_update_speed);
}

TEST(Config, WithoutPresetTheModelDefaultsAreHuggingFaceDeepSeekV3) {
  const TrainConfig c = load("train_batch_size: 8\nmodel:\n  vocab_size: 256\n");
  EXPECT_EQ(c.model.hidden_size, 7168);
  EXPECT_EQ(c.model.num_hidden_layers, 61);
  EXPECT_EQ(c.model.n_routed_experts, 256);
  EXPECT_EQ(c.model.vocab_size, 256);
}

TEST(Config, SetOverridesScalarsListsAndNewSections) {
  const TrainConfig c = load(base_yaml(), {"parallel.tensor=2", "optimizer.params.betas=[0.8, 0.9]",
                                           "scheduler.type=WarmupDecayLR", "bf16.enabled=true",
                                           "model.rope_scaling={factor: 4.0}"});
  EXPECT_EQ(c.parallel.tensor, 2);
  EXPECT_EQ(c.optimizer.params.betas, (std::vector<double>{0.8, 0.9}));
  ASSERT_TRUE(c.scheduler.has_value());
  EXPECT_EQ(c.scheduler->type, SchedulerType::kWarmupDecayLR);
  EXPECT_EQ(c.precision(), Precision::kBf16);
  ASSERT_TRUE(c.model.rope_scaling.has_value());
  EXPECT_EQ(c.model.rope_scaling->factor, 4.0);
  EXPECT_EQ(c.model.rope_scaling->beta_fast, 32.0);
  EXPECT_EQ(c.source.at("parallel.tensor"), "--set parallel.tensor=2");
  EXPECT_EQ(c.source.at("model.rope_scaling.factor"), "--set model.rope_scaling={factor: 4.0}");
}

TEST(Config, SetWinsOverTheFile) {
  const TrainConfig c = load(base_yaml() + "seed: 5\n", {"seed=7"});
  EXPECT_EQ(c.seed, 7);
}

TEST(Config, SourcePositionsAreOneBasedLineAndColumn) {
  const TrainConfig c = load(base_yaml() + "parallel:\n  tensor: 2\n");
  EXPECT_EQ(c.source.at("parallel.tensor"), "test.yaml:7:3");
  EXPECT_EQ(c.source.at("model.preset"), "test.yaml:3:3");
  EXPECT_EQ(c.source.at("model.hidden_size"), "test.yaml:3:3 (value from model.preset)");
  EXPECT_EQ(c.source.at("seed"), "test.yaml (default)");
}

TEST(Config, EmptySectionKeepsDefaults) {
  const TrainConfig c = load(base_yaml() + "fp16:\n");
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
}

TEST(Config, IntegersMayBeWrittenAsIntegralFloats) {
  const TrainConfig c = load(base_yaml() + "train_steps: 1e3\n");
  EXPECT_EQ(c.train_steps, 1000);
}

TEST(Config, DecayingSchedulersDefaultTheirLengthToTrainSteps) {
  const TrainConfig c = load(base_yaml() + "train_steps: 77\nscheduler:\n  type: WarmupCosineLR\n"
                                           "  params:\n    warmup_num_steps: 7\n");
  ASSERT_TRUE(c.scheduler);
  EXPECT_EQ(c.scheduler->params.total_num_steps, 77);
  EXPECT_EQ(c.scheduler->params.cos_min_ratio, 0.0001);
}

TEST(Config, KeyListCoversEverySectionAndSchedulerType) {
  const auto& keys = all_key_paths();
  for (const char* k : {"train_batch_size", "fp16.loss_scale_window", "bf16.enabled",
                        "zero_optimization.stage", "optimizer.params.betas", "scheduler.type",
                        "scheduler.params.warmup_max_lr", "scheduler.params.cos_min_ratio",
                        "scheduler.params.total_num_steps", "activation_checkpointing.enabled",
                        "model.preset", "model.rope_scaling.mscale_all_dim", "parallel.data",
                        "data.path", "checkpoint.resume", "monitor.metrics_file",
                        "wall_clock_breakdown", "seq_length", "train_steps", "seed"})
    EXPECT_NE(std::find(keys.begin(), keys.end(), k), keys.end()) << k;
}

// --print-config output is itself a valid config that resolves to the same thing.
TEST(Config, PrintedConfigRoundTrips) {
  for (const std::string& name : preset_names()) {
    const TrainConfig a = load_config_file("configs/" + name + ".yaml");
    const std::string text = to_yaml(a);
    const TrainConfig b = load(text);
    EXPECT_EQ(to_yaml(b), text) << name;
  }
  // A run shorter than its warmup: the resolved total_num_steps (train_steps) loads again.
  const TrainConfig a = load_config_file("configs/tiny.yaml", {"train_steps=2"});
  ASSERT_TRUE(a.scheduler.has_value());
  ASSERT_LT(2, a.scheduler->params.warmup_num_steps);
  const std::string text = to_yaml(a);
  EXPECT_EQ(to_yaml(load(text)), text);
}

TEST(Config, PrintedConfigListsDefaults) {
  const std::string text = to_yaml(load(base_yaml()));
  EXPECT_NE(text.find("loss_scale_window: 1000"), std::string::npos);
  EXPECT_NE(text.find("data: auto"), std::string::npos);
  EXPECT_NE(text.find("scheduler: ~"), std::string::npos);
  EXPECT_NE(text.find("q_lora_rank: 48"), std::string::npos);
}

}  // namespace
}  // namespace dstrain::config

namespace dstrain::config {
namespace {

TEST(ConfigReference, EveryKeyIsDocumented) {
  const auto rows = config_reference();
  for (const std::string& key : all_key_paths()) {
    const auto it = std::find_if(rows.begin(), rows.end(), [&](const KeyDoc& r) { return r.path == key; });
    ASSERT_NE(it, rows.end()) << key;
    EXPECT_FALSE(it->meaning.empty()) << "no meaning for " << key << " in key_meanings.cpp";
    EXPECT_FALSE(it->type.empty()) << key;
  }
}

// The config reference (docs/config-reference.md, linked from the README's "Config reference")
// is the generated table; regenerate it with `build/bin/dstrain --config-reference` when the
// schema changes.
TEST(ConfigReference, ReadmeCarriesTheGeneratedTable) {
  std::ifstream in("docs/config-reference.md");
  std::stringstream reference;
  reference << in.rdbuf();
  EXPECT_NE(reference.str().find(config_reference_markdown()), std::string::npos)
      << "docs/config-reference.md is out of date";
}

}  // namespace
}  // namespace dstrain::config
