// Bad input, table-driven: each config must fail with one line that names where (file:line:col
// or the --set text), the key path, the value and what is valid. The expected fragments are
// exact substrings of the message.
#include <gtest/gtest.h>

#include <chrono>

#include <fmt/format.h>

#include "engine/plan/parallel_plan.h"
#include "tests/unit/test_helpers.h"

namespace dstrain {
namespace {

struct BadCase {
  const char* name;
  std::string yaml;
  std::vector<std::string> sets;
  int world_size;
  std::vector<std::string> fragments;
};

std::string base() { return testing::base_yaml(); }

std::vector<BadCase> cases() {
  return {
      {"unknown_top_level_key", "train_batch_sise: 8\n" + base(), {}, 1,
       {"test.yaml:1:1: train_batch_sise: unknown key; did you mean 'train_batch_size'?"}},
      {"unknown_nested_key", base() + "zero_optimization:\n  stgae: 1\n", {}, 1,
       {"test.yaml:7:3: zero_optimization.stgae: unknown key; did you mean "
        "'zero_optimization.stage'?",
        "valid keys here: stage"}},
      {"key_in_wrong_section", base() + "stage: 2\n", {}, 1,
       {"test.yaml:6:1: stage: unknown key; did you mean 'zero_optimization.stage'?"}},
      {"scheduler_key_of_another_type",
       base() + "scheduler:\n  type: WarmupLR\n  params:\n    cos_min_ratio: 0.1\n", {}, 1,
       {"test.yaml:9:5: scheduler.params.cos_min_ratio: unknown key",
        "valid keys here: warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type"}},
      {"string_for_integer", base() + "train_steps: ten\n", {}, 1,
       {"test.yaml:6:1: train_steps: invalid value ten: expected an integer"}},
      {"word_for_bool", base() + "bf16:\n  enabled: yes please\n", {}, 1,
       {"test.yaml:7:3: bf16.enabled: invalid value yes please: expected true or false"}},
      {"scalar_for_section", base() + "fp16: 3\n", {}, 1,
       {"fp16: invalid value 3: expected a mapping of keys"}},
      {"list_for_scalar", base() + "seed: [1, 2]\n", {}, 1,
       {"seed: invalid value [1, 2]: expected an integer"}},
      {"zero_stage_out_of_range", base() + "zero_optimization:\n  stage: 3\n", {}, 1,
       {"test.yaml:7:3: zero_optimization.stage: invalid value 3: valid: an integer from 0 to 2"}},
      {"negative_learning_rate", base() + "optimizer:\n  params:\n    lr: -1\n", {}, 1,
       {"optimizer.params.lr: invalid value -1: valid: a number >= 0"}},
      {"unknown_optimizer", base() + "optimizer:\n  type: SGD\n", {}, 1,
       {"optimizer.type: invalid value SGD: valid: one of AdamW, Adam"}},
      {"betas_wrong_length", base() + "optimizer:\n  params:\n    betas: [0.9]\n", {}, 1,
       {"optimizer.params.betas: 1 values; valid: a list of two numbers in [0, 1)"}},
      {"beta_out_of_range", base(), {"optimizer.params.betas=[0.9, 1.5]"}, 1,
       {"--set optimizer.params.betas=[0.9, 1.5]: optimizer.params.betas: invalid value [0.9, "
        "1.5]: each element must be a number from 0 to 1 (exclusive)"}},
      {"heads_not_divisible_by_tp", base(), {"parallel.tensor=3"}, 3,
       {"--set parallel.tensor=3: parallel.tensor: 3 does not divide model.num_attention_heads = 4",
        "valid: a divisor of 4: 1, 2, 4"}},
      {"fewer_layers_than_stages", base() + "parallel:\n  pipeline: 3\n", {}, 3,
       {"test.yaml:7:3: parallel.pipeline: 3 pipeline stages but the model has only 2 layers",
        "valid: 1 to 2"}},
      {"experts_not_divisible_by_ep", base() + "parallel:\n  expert: 3\n", {}, 3,
       {"parallel.expert: 3 does not divide model.n_routed_experts = 4",
        "valid: a divisor of 4: 1, 2, 4"}},
      {"ep_not_dividing_data_parallel", base() + "parallel:\n  expert: 2\n", {}, 3,
       {"parallel.expert: 2 does not divide the data-parallel size 3"}},
      {"ep_not_dividing_explicit_data", base() + "parallel:\n  expert: 4\n  data: 2\n", {}, 2,
       {"parallel.expert: 4 does not divide parallel.data = 2"}},
      {"batch_triangle_mismatch",
       base() + "train_micro_batch_size_per_gpu: 3\ngradient_accumulation_steps: 2\n", {}, 1,
       {"test.yaml:1:1: train_batch_size: 8 != train_micro_batch_size_per_gpu 3 x "
        "gradient_accumulation_steps 2 x data-parallel size 1 = 6; valid: 6"}},
      {"batch_not_divisible_by_micro", base() + "train_micro_batch_size_per_gpu: 3\n", {}, 1,
       {"train_batch_size: 8 is not divisible by train_micro_batch_size_per_gpu 3 x data-parallel "
        "size 1 = 3"}},
      {"batch_not_divisible_by_dp", base(), {}, 3,
       {"train_batch_size: 8 is not divisible by the data-parallel size = 3"}},
      {"no_batch_size", "model:\n  preset: tiny\n", {}, 1,
       {"train_batch_size: neither train_batch_size nor train_micro_batch_size_per_gpu is set"}},
      {"world_not_multiple_of_model_parallel", base() + "parallel:\n  tensor: 2\n", {}, 3,
       {"test.yaml:7:3: parallel.tensor: world size 3 is not a multiple of parallel.tensor 2 x "
        "parallel.pipeline 1 = 2"}},
      {"world_not_product_of_degrees", base() + "parallel:\n  tensor: 2\n  data: 2\n", {}, 8,
       {"test.yaml:8:3: parallel.data: tensor 2 x pipeline 1 x data 2 = 4 ranks, but the world "
        "size is 8; valid: data: 4 or data: auto"}},
      {"data_degree_zero", base() + "parallel:\n  data: 0\n", {}, 1,
       {"parallel.data: invalid value 0: expected auto or an integer >= 1"}},
      {"missing_data_file", base(), {"data.path=no/such/file.txt"}, 1,
       {"--set data.path=no/such/file.txt: data.path: 'no/such/file.txt' is not a readable file"}},
      {"malformed_yaml", "model: [unclosed\n", {}, 1, {"test.yaml:2:1: malformed YAML"}},
      {"empty_config", "", {}, 1, {"test.yaml: the config is empty"}},
      {"top_level_list", "- a\n- b\n", {}, 1,
       {"test.yaml:1:1: the config must be a YAML mapping of keys"}},
      {"duplicate_key", base() + "train_batch_size: 16\n", {}, 1,
       {"train_batch_size: duplicate key (first given at line 1)"}},
      {"fp16_and_bf16", base() + "fp16:\n  enabled: true\nbf16:\n  enabled: true\n", {}, 1,
       {"test.yaml:9:3: bf16.enabled: true while fp16.enabled is also true"}},
      {"unknown_preset", "train_batch_size: 8\nmodel:\n  preset: huge\n", {}, 1,
       {"test.yaml:3:3: model.preset: invalid value huge: valid: one of tiny, small, medium, "
        "deepseek-v2-lite, deepseek-v3"}},
      {"kv_heads_differ", base(), {"model.num_key_value_heads=2"}, 1,
       {"model.num_key_value_heads: 2 differs from model.num_attention_heads = 4"}},
      {"odd_rope_dim", base(), {"model.qk_rope_head_dim=7"}, 1,
       {"model.qk_rope_head_dim: 7 is odd"}},
      {"sequence_too_long", base() + "seq_length: 4096\n", {}, 1,
       {"test.yaml:6:1: seq_length: 4096 is longer than model.max_position_embeddings = 512"}},
      {"group_count_not_dividing_experts", base(), {"model.n_group=3"}, 1,
       {"model.n_group: 3 groups do not divide model.n_routed_experts = 4"}},
      {"too_many_experts_per_token", base(), {"model.num_experts_per_tok=5"}, 1,
       {"model.num_experts_per_tok: 5 experts per token but only 4 routed experts"}},
      {"v3_with_softmax_routing", base(), {"model.scoring_func=softmax"}, 1,
       {"model.scoring_func: model_type deepseek_v3 routes with scoring_func sigmoid"}},
      {"tied_embeddings", base(), {"model.tie_word_embeddings=true"}, 1,
       {"model.tie_word_embeddings: true, but DeepSeek models keep lm_head untied"}},
      {"stage_layers_wrong_sum", base() + "parallel:\n  pipeline: 2\n  stage_layers: [1, 2]\n", {},
       2, {"parallel.stage_layers: the counts add up to 3 layers but the model has 2"}},
      {"stage_layers_wrong_count", base(), {"parallel.pipeline=2", "parallel.stage_layers=[1,1,0]"}, 2,
       {"parallel.stage_layers: invalid value [1, 1, 0]: each element must be an integer >= 1"}},
      {"stage_layers_for_fewer_stages", base(), {"model.num_hidden_layers=4", "parallel.pipeline=2",
                                                 "parallel.stage_layers=[1,1,2]"},
       2, {"parallel.stage_layers: 3 entries for 2 pipeline stages (parallel.pipeline); valid: one layer count per "
           "stage"}},
      {"interleaved_with_fewer_micro_batches_than_stages", base(),
       {"model.num_hidden_layers=4", "parallel.pipeline=2", "parallel.pipeline_schedule=interleaved",
        "parallel.virtual_stages=2", "train_micro_batch_size_per_gpu=8"},
       2, {"parallel.pipeline_schedule: interleaved: the interleaved schedule runs the micro-batches in groups of one "
           "per pipeline stage: gradient_accumulation_steps = 1 must be a multiple of parallel.pipeline = 2",
           "valid: train_batch_size = micro-batch x gradient_accumulation_steps x data ranks"}},
      {"chunks_without_interleaving", base(), {"model.num_hidden_layers=4", "parallel.pipeline=2",
                                               "parallel.virtual_stages=2"},
       2, {"parallel.virtual_stages: 2 model chunks per pipeline rank, but parallel.pipeline_schedule is 1f1b; valid: "
           "1, or set parallel.pipeline_schedule: interleaved"}},
      {"more_virtual_stages_than_layers", base(), {"parallel.pipeline=2", "parallel.pipeline_schedule=interleaved",
                                                   "parallel.virtual_stages=2"},
       2, {"parallel.virtual_stages: 2 pipeline stages x 2 chunks = 4 virtual stages but the model has only 2 layers"}},
      {"unknown_schedule", base(), {"parallel.pipeline_schedule=zb-h2"}, 1,
       {"parallel.pipeline_schedule: invalid value zb-h2: valid: one of gpipe, 1f1b, interleaved, zb-h1"}},
      {"resume_path_missing", base(), {"checkpoint.resume=ckpt/none-here"}, 1,
       {"checkpoint.resume: 'ckpt/none-here' does not exist"}},
      {"scheduler_shorter_than_warmup",
       base() + "scheduler:\n  type: WarmupDecayLR\n  params:\n    warmup_num_steps: 100\n"
                "    total_num_steps: 10\n",
       {}, 1, {"scheduler.params.total_num_steps: 10 is fewer than scheduler.params.warmup_num_steps"}},
      {"sequence_parallel_with_an_odd_split", base(), {"parallel.tensor=2", "parallel.sequence_parallel=true",
                                                      "seq_length=63"},
       2, {"parallel.sequence_parallel: true, but seq_length 63 is not divisible by parallel.tensor 2"}},
      {"vocabulary_too_small_for_tp", base(), {"parallel.tensor=4", "model.vocab_size=5"}, 4,
       {"parallel.tensor: 4 splits model.vocab_size = 5 into blocks of 2 rows, leaving the last rank none; valid: "
        "at most 3"}},
      {"set_without_value", base(), {"parallel.tensor"}, 1,
       {"--set parallel.tensor: expected key.path=value"}},
      {"set_through_a_value", base() + "seed: 5\n", {"seed.x=1"}, 1,
       {"--set seed.x=1: seed is a value, not a section, so it has no key 'x'"}},
      {"set_creates_a_section_where_a_value_belongs", base(), {"seed.x=1"}, 1,
       {"--set seed.x=1: seed: invalid value {x: 1}: expected an integer"}},
      {"set_unknown_key", base(), {"parallel.tensr=2"}, 1,
       {"--set parallel.tensr=2: parallel.tensr: unknown key; did you mean 'parallel.tensor'?"}},
      // Sizes the plan's 64-bit counts cannot hold: refused, never printed wrapped around.
      {"hidden_size_overflows_the_counts", base(), {"model.hidden_size=4611686018427387904"}, 1,
       {"--set model.hidden_size=4611686018427387904: model.hidden_size: 4611686018427387904 is more than the "
        "16,777,216 a model size may be (the plan's 64-bit counts must not wrap); valid: 1 to 16,777,216"}},
      {"intermediate_size_overflows_the_counts", base(), {"model.intermediate_size=3e18"}, 1,
       {"--set model.intermediate_size=3e18: model.intermediate_size: 3000000000000000000 is more than the "
        "16,777,216 a model size may be"}},
      {"hidden_size_at_int64_max", base(), {"model.hidden_size=9223372036854775807"}, 1,
       {"model.hidden_size: 9223372036854775807 is more than the 16,777,216"}},
      // Two sizes whose product wraps int64 to a small positive number (2^32 + 1 squared): refused
      // by their own bound, before any product is formed.
      {"shared_expert_width_wraps", base(), {"model.n_shared_experts=4294967297", "model.moe_intermediate_size=4294967297"},
       1, {"model.moe_intermediate_size: 4294967297 is more than the 16,777,216 a model size may be"}},
      {"tensor_too_large", base(), {"model.hidden_size=16777216", "model.v_head_dim=16777216"}, 1,
       {"would have", "elements, more than the 2.81e+14 a tensor may have; valid: the sizes of a real model"}},
      {"model_too_large_in_total", base(), {"model.n_routed_experts=100000", "model.moe_intermediate_size=100000",
                                            "model.hidden_size=100000", "model.num_attention_heads=4"},
       1, {"the model would have 3e+15 parameters, more than the 1.13e+15 dstrain plans for"}},
      {"sequence_too_long_to_count", base(), {"seq_length=16777216", "model.max_position_embeddings=16777216",
                                              "train_micro_batch_size_per_gpu=8", "model.num_attention_heads=8",
                                              "model.num_key_value_heads=8"},
       1, {"seq_length: 16777216: one micro-batch of 8 x 16777216 tokens would need about", "more than dstrain can count"}},
      {"powersgd_with_zero2", base(), {"zero_optimization.stage=2", "gradient_compression.rank=4"}, 2,
       {"gradient_compression: powersgd with zero_optimization.stage 2", "valid: zero_optimization.stage 0 or 1"}},
      {"powersgd_with_a_pipeline", base(), {"parallel.pipeline=2", "gradient_compression.type=powersgd"}, 2,
       {"gradient_compression: powersgd with parallel.pipeline 2", "valid: parallel.pipeline 1"}},
      {"powersgd_with_16_bit_messages", base(), {"communication_data_type=bf16", "gradient_compression.rank=2"}, 2,
       {"gradient_compression: powersgd with communication_data_type bf16: PowerSGD sends its factors in fp32"}},
      {"powersgd_of_another_type", base(), {"gradient_compression.type=topk"}, 1,
       {"gradient_compression.type", "valid: one of powersgd"}},
      {"micro_batch_beyond_any_batch_size", base(), {"train_micro_batch_size_per_gpu=4611686018427387904"}, 1,
       {"train_micro_batch_size_per_gpu: 4611686018427387904 is more than the 16,777,216 a batch size may be"}},
      {"accumulation_beyond_any_batch_size", base(), {"gradient_accumulation_steps=3e9"}, 1,
       {"gradient_accumulation_steps: 3000000000 is more than the 16,777,216 a batch size may be"}},
      // Three factors within their bounds whose product, with 32,768 data-parallel ranks, leaves
      // 64-bit counts (2^24 x 2^24 x 2^15 = 2^63).
      {"batch_product_overflows", base(), {"train_micro_batch_size_per_gpu=16777216",
                                           "gradient_accumulation_steps=16777216", "train_batch_size=16777216"},
       32768, {"train_batch_size: micro-batch x accumulation x data-parallel size leaves 64-bit counts"}},
      {"sequence_beyond_any_model_size", base(), {"seq_length=200000000", "model.max_position_embeddings=200000000"},
       1, {"model.max_position_embeddings: 200000000 is more than the 16,777,216 a model size may be"}},
  };
}

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

class BadConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfig, FailsWithOneClearLine) {
  const BadCase& c = GetParam();
  std::string message;
  try {
    const config::TrainConfig cfg = testing::load(c.yaml, c.sets);
    plan::make_plan(cfg, c.world_size);
  } catch (const ConfigError& e) {
    message = e.what();
  }
  ASSERT_FALSE(message.empty()) << "accepted: " << c.name;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  for (const auto& f : c.fragments) EXPECT_NE(message.find(f), std::string::npos) << message;
}

INSTANTIATE_TEST_SUITE_P(Table, BadConfig, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(BadConfigTable, HasAtLeast25Cases) { EXPECT_GE(cases().size(), 25u); }

// Aliases nested in aliases (a "billion laughs") under a valid list key: refused before any
// walk expands them, in well under a second, with a message of normal length.
TEST(BadConfigFile, AliasBombIsRefusedQuickly) {
  // The anchors under keys of their own, and (the case) all of them inside the valid
  // list key monitor.trace_steps, where nothing else is wrong with the config.
  std::string outside = base() + "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n";
  std::string inside = base() + "monitor:\n  trace_steps: [&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]";
  for (int i = 1; i < 9; ++i) {
    const std::string list =
        fmt::format("[*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]", fmt::arg("p", i - 1));
    outside += fmt::format("a{}: &a{} {}\n", i, i, list);
    inside += fmt::format(", &a{} {}", i, list);
  }
  outside += "monitor:\n  trace_steps: *a8\n";
  inside += "]\n";
  for (const std::string& yaml : {outside, inside}) {
    const auto t0 = std::chrono::steady_clock::now();
    std::string message;
    try {
      testing::load(yaml);
    } catch (const ConfigError& e) {
      message = e.what();
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(message.find("test.yaml: the config expands to more than 100,000 YAML nodes"), std::string::npos)
        << message.substr(0, 300);
    EXPECT_LT(message.size(), 400u);
    EXPECT_LT(secs, 2.0);
  }
  // A value quoted in an error is cut short.
  std::string list = "[";
  for (int i = 0; i < 500; ++i) list += "100000, ";
  list += "1]";
  try {
    testing::load(base() + "seed: " + list + "\n");
    FAIL() << "accepted a list for seed";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("... (4003 characters)"), std::string::npos) << e.what();
    EXPECT_LT(std::string(e.what()).size(), 400u);
  }
}

TEST(BadConfigFile, MissingFileIsNamed) {
  try {
    config::load_config_file("configs/does-not-exist.yaml");
    FAIL() << "accepted a missing file";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "configs/does-not-exist.yaml: cannot open the config file (does it exist?)");
  }
}

}  // namespace
}  // namespace dstrain
