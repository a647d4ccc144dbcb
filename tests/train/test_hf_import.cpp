// dstrain-ckpt import-hf's library half (engine/runtime/hf_import.h) against Hugging Face: tiny
// DeepSeek-V3 models saved by transformers (tools/make_hf_import_golden.py; bf16 in three shards
// with an index, fp32 in one file) import into weights-only checkpoints whose weights give
// transformers' float64 logits to 1e-5; a run starts from one with fresh optimizer state; and
// every bad input — missing or truncated files, a config.json that does not match the weights,
// another architecture, FP8 — is one clear error that leaves nothing behind.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/config/load_config.h"
#include "engine/io/hdf5_file.h"
#include "engine/model/deepseek_model.h"
#include "engine/plan/parallel_plan.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/hf_import.h"
#include "engine/runtime/trainer.h"

namespace dstrain::runtime {
namespace {
namespace fs = std::filesystem;

std::string fresh_dir(const std::string& name) {
  const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string d = ::testing::TempDir() + "/hf_import_" + (t ? std::string(t->name()) + "_" : "") + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

class HfImportGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(HfImportGolden, ImportedWeightsGiveTransformersLogits) {
  const std::string src = "tests/data/hf_import/" + GetParam(), out = fresh_dir("out") + "/imported.h5";
  const HfImport r = import_hf_checkpoint(src, out);
  EXPECT_EQ(r.tensors, 41);
  EXPECT_FALSE(r.mtp_dropped);
  EXPECT_NE(std::find(r.ignored_keys.begin(), r.ignored_keys.end(), "transformers_version"), r.ignored_keys.end());
  EXPECT_EQ(verify_checkpoint(out), 41);  // every checksum, no optimizer groups

  int version = 0;
  const auto f = open_checkpoint_file(out, &version);
  EXPECT_TRUE(weights_only(*f));
  const config::TrainConfig cfg = config::load_config_text(f->attr_string("config_yaml"), out);
  const config::ModelConfig& m = cfg.model;
  EXPECT_TRUE(config::model_changes(f->attr_string("hf_config"),
                                    config::load_config_file("configs/tiny.yaml").model).empty())
      << "the imported model is tiny.yaml's";
  const plan::ParallelPlan plan = plan::make_plan(cfg, 1);
  model::ParamStore params(plan.params, plan.param_stage, m.num_routed(), model::ShardCoords{});
  for (const std::string& name : params.names())
    params.load_full(name, read_checked_tensor(*f, "model/" + name, version).data());

  io::H5File golden(src + "/golden.h5", io::H5File::Mode::kRead);
  const std::vector<int32_t> inputs = golden.read_ints("tokens");
  const int64_t B = golden.shape("tokens")[0], S = golden.shape("tokens")[1];
  std::vector<int32_t> tokens;  // each row's inputs and one more token (a target, unused here)
  for (int64_t b = 0; b < B; ++b) {
    tokens.insert(tokens.end(), inputs.begin() + b * S, inputs.begin() + (b + 1) * S);
    tokens.push_back(0);
  }
  auto be = kernels::make_cpu_backend(2);
  model::LocalCollectives coll;
  model::DeepSeekModel net(m, *be, coll, params, B, S, false, {});
  net.keep_logits(true);
  net.forward(tokens.data(), {double(B * S), double(B), 1.0, false});
  const std::vector<float> want = golden.read_floats("logits");
  ASSERT_EQ(int64_t(want.size()), B * S * m.vocab_size);
  double scale = 0, worst = 0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  for (size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::fabs(double(net.logits().data()[i]) - double(want[i])));
  EXPECT_LE(worst / scale, 1e-5) << "logits: worst |dstrain - transformers| " << worst << " of " << scale;
  EXPECT_GT(scale, 0.1);
}

INSTANTIATE_TEST_SUITE_P(Transformers, HfImportGolden, ::testing::Values("tiny_bf16", "tiny_fp32"));

// A run started from an imported checkpoint: the weights are the file's, the optimizer state and
// the schedule fresh (step 0); it trains like a run started from the same weights.
TEST(HfImport, ARunStartsFromTheWeightsWithFreshOptimizerState) {
  const std::string dir = fresh_dir("run"), out = dir + "/imported.h5";
  import_hf_checkpoint("tests/data/hf_import/tiny_fp32", out);
  const plan::ParallelPlan p = plan::make_plan(
      config::load_config_file("configs/tiny.yaml", {"checkpoint.dir=" + dir + "/ckpt", "checkpoint.resume=" + out,
                                                     "data.eval_interval=0", "monitor.expert_stats_interval=0"}),
      1);
  Trainer t(p, 2);
  EXPECT_EQ(t.start_step(), 0);
  const auto f = open_checkpoint_file(out);
  const std::vector<float> want = read_checked_tensor(*f, "model/model.layers.1.mlp.experts.2.down_proj.weight", 2);
  std::vector<float> got(want.size());
  t.params().store_full("model.layers.1.mlp.experts.2.down_proj.weight", got.data());
  EXPECT_EQ(got, want);
  const double first = t.train_step(0).loss.ce;
  EXPECT_TRUE(std::isfinite(first));
  // Trained from these weights the loss falls.
  double last = first;
  for (int64_t s = 1; s < 8; ++s) last = t.train_step(s).loss.ce;
  EXPECT_LT(last, first);
}

// Copies a golden model directory to damage it.
std::string copy_of(const std::string& variant, const std::string& dir) {
  const std::string to = dir + "/" + variant;
  fs::create_directories(dir);
  fs::copy("tests/data/hf_import/" + variant, to, fs::copy_options::recursive);
  return to;
}

void expect_refused(const std::string& src, const std::string& out, const std::string& message) {
  try {
    import_hf_checkpoint(src, out);
    ADD_FAILURE() << "imported " << src << "; expected: " << message;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(out)) << "a refused import left " << out;
  EXPECT_FALSE(fs::exists(out + ".tmp")) << "a refused import left " << out << ".tmp";
}

void rewrite_config(const std::string& dir, const std::string& from, const std::string& to) {
  std::ifstream in(dir + "/config.json");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  text.replace(at, from.size(), to);
  std::ofstream(dir + "/config.json") << text;
}

// A DeepSeek-V2 config.json without its routing keys (transformers' own DeepseekV2Config writes
// no scoring_func) imports with V2's routing, not dstrain's V3 defaults; given keys win.
TEST(HfImport, DeepSeekV2ConfigsGetV2RoutingDefaults) {
  const std::string v2 = R"({"model_type": "deepseek_v2", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 4, "q_lora_rank": null, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
      "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1,
      "num_experts_per_tok": 2, "first_k_dense_replace": 1, "max_position_embeddings": 512})";
  std::vector<std::string> ignored;
  const config::ModelConfig m = config::model_from_hf_config(v2, "v2/config.json", &ignored);
  EXPECT_EQ(m.scoring_func, config::ScoringFunc::kSoftmax);
  EXPECT_EQ(m.topk_method, config::TopkMethod::kGreedy);
  EXPECT_FALSE(m.norm_topk_prob);
  EXPECT_EQ(m.routed_scaling_factor, 1.0);
  std::string scaled = v2;
  scaled.insert(1, R"("routed_scaling_factor": 16.0, )");
  EXPECT_EQ(config::model_from_hf_config(scaled, "v2/config.json").routed_scaling_factor, 16.0);
}

TEST(HfImport, BadInputsAreOneClearErrorAndLeaveNothing) {
  const std::string dir = fresh_dir("bad"), out = dir + "/out.h5";
  {
    const std::string d = copy_of("tiny_bf16", dir + "/missing_shard");
    fs::remove(d + "/model-00002-of-00003.safetensors");
    expect_refused(d, out, "model-00002-of-00003.safetensors: missing (model.safetensors.index.json names it for");
  }
  {
    const std::string d = copy_of("tiny_bf16", dir + "/truncated");
    const std::string shard = d + "/model-00003-of-00003.safetensors";
    fs::resize_file(shard, fs::file_size(shard) - 100);
    expect_refused(d, out, "(a truncated file?)");
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/short_header");
    fs::resize_file(d + "/model.safetensors", 200);
    expect_refused(d, out, "model.safetensors: the header needs");
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/shape");
    rewrite_config(d, "\"moe_intermediate_size\": 32", "\"moe_intermediate_size\": 48");
    expect_refused(d, out, "tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' is [32, 64], config.json's model "
                           "makes it [48, 64]");
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/fewer_layers");
    rewrite_config(d, "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    expect_refused(d, out, "is not part of the model config.json describes");
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/llama");
    rewrite_config(d, "\"model_type\": \"deepseek_v3\"", "\"model_type\": \"llama\"");
    expect_refused(d, out, "model_type \"llama\": dstrain trains DeepSeek-V2 / V3 models");
  }
  {  // FP8 weights, as DeepSeek-V3 releases them: a weight_scale_inv beside a matrix (in its own shard)
    const std::string d = copy_of("tiny_bf16", dir + "/fp8");
    const std::string header =
        R"({"model.layers.0.self_attn.q_a_proj.weight_scale_inv":{"dtype":"F32","shape":[1,1],"data_offsets":[0,4]}})";
    std::ofstream st(d + "/model-scales.safetensors", std::ios::binary);
    const uint64_t n = header.size();
    const float one = 1.0f;
    st.write(reinterpret_cast<const char*>(&n), 8).write(header.data(), std::streamsize(n));
    st.write(reinterpret_cast<const char*>(&one), 4);
    st.close();
    nlohmann::json index = nlohmann::json::parse(std::ifstream(d + "/model.safetensors.index.json"));
    index["weight_map"]["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = "model-scales.safetensors";
    std::ofstream(d + "/model.safetensors.index.json") << index.dump();
    rewrite_config(d, "\"model_type\": \"deepseek_v3\"",
                   "\"model_type\": \"deepseek_v3\", \"quantization_config\": {\"quant_method\": \"fp8\"}");
    expect_refused(d, out, "belongs to FP8-quantized weights: dequantize them to bf16 first");
  }
  {  // config.json asks for an MTP layer the files do not hold (transformers saves none)
    const std::string d = copy_of("tiny_fp32", dir + "/mtp_copy");
    rewrite_config(d, "\"num_nextn_predict_layers\": 0", "\"num_nextn_predict_layers\": 1");
    // (no MTP weights: imported without the module, said in the result)
    const HfImport r = import_hf_checkpoint(d, dir + "/mtp_dropped.h5");
    EXPECT_TRUE(r.mtp_dropped);
    EXPECT_EQ(r.model.num_nextn_predict_layers, 0);
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/bad_value");
    rewrite_config(d, "\"hidden_size\": 64", "\"hidden_size\": -64");
    expect_refused(d, out, "model.hidden_size");
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/no_config");
    fs::remove(d + "/config.json");
    expect_refused(d, out, "no config.json");
  }
  {
    const std::string d = copy_of("tiny_fp32", dir + "/no_weights");
    fs::remove(d + "/model.safetensors");
    expect_refused(d, out, "neither model.safetensors nor model.safetensors.index.json");
  }
  // An existing output is not overwritten.
  std::ofstream(out) << "precious";
  try {
    import_hf_checkpoint("tests/data/hf_import/tiny_fp32", out);
    ADD_FAILURE() << "overwrote " << out;
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("exists"), std::string::npos) << e.what();
  }
  std::ifstream kept(out);
  std::string text;
  kept >> text;
  EXPECT_EQ(text, "precious");
}

}  // namespace
}  // namespace dstrain::runtime
