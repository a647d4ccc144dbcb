// The model section as a Hugging Face config.json (docs/model.md §2 fields, §12 exchange
// format), written with nlohmann::json so that any string — an architecture name, a path — is
// escaped as JSON requires.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <string>

#include "engine/common/error.h"
#include "engine/config/load_config.h"

namespace dstrain::config {
namespace {

using Json = nlohmann::ordered_json;  // keys in the order written, like HF's own files

Json optional_int(const std::optional<int64_t>& v) { return v ? Json(*v) : Json(nullptr); }

}  // namespace

std::string to_hf_config_json(const ModelConfig& m) {
  Json j;
  j["architectures"] = m.architectures.empty()
                           ? std::vector<std::string>{m.model_type == ModelType::kDeepseekV2 ? "DeepseekV2ForCausalLM"
                                                                                             : "DeepseekV3ForCausalLM"}
                           : m.architectures;
  j["model_type"] = to_string(m.model_type);
  j["vocab_size"] = m.vocab_size;
  j["hidden_size"] = m.hidden_size;
  j["intermediate_size"] = m.intermediate_size;
  j["moe_intermediate_size"] = m.moe_intermediate_size;
  j["num_hidden_layers"] = m.num_hidden_layers;
  j["num_attention_heads"] = m.num_attention_heads;
  j["num_key_value_heads"] = m.num_key_value_heads;
  j["q_lora_rank"] = optional_int(m.q_lora_rank);
  j["kv_lora_rank"] = m.kv_lora_rank;
  j["qk_nope_head_dim"] = m.qk_nope_head_dim;
  j["qk_rope_head_dim"] = m.qk_rope_head_dim;
  j["v_head_dim"] = m.v_head_dim;
  j["n_routed_experts"] = optional_int(m.n_routed_experts);
  j["n_shared_experts"] = optional_int(m.n_shared_experts);
  j["num_experts_per_tok"] = m.num_experts_per_tok;
  j["first_k_dense_replace"] = m.first_k_dense_replace;
  j["moe_layer_freq"] = m.moe_layer_freq;
  j["scoring_func"] = to_string(m.scoring_func);
  j["topk_method"] = to_string(m.topk_method);
  j["n_group"] = m.n_group;
  j["topk_group"] = m.topk_group;
  j["norm_topk_prob"] = m.norm_topk_prob;
  j["routed_scaling_factor"] = m.routed_scaling_factor;
  j["aux_loss_alpha"] = m.aux_loss_alpha;
  j["seq_aux"] = m.seq_aux;
  j["rms_norm_eps"] = m.rms_norm_eps;
  j["rope_theta"] = m.rope_theta;
  if (m.rope_scaling) {
    const RopeScaling& r = *m.rope_scaling;
    j["rope_scaling"] = Json{{"type", r.type},
                             {"factor", r.factor},
                             {"original_max_position_embeddings", r.original_max_position_embeddings},
                             {"beta_fast", r.beta_fast},
                             {"beta_slow", r.beta_slow},
                             {"mscale", r.mscale},
                             {"mscale_all_dim", r.mscale_all_dim}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["rope_interleave"] = m.rope_interleave;
  j["max_position_embeddings"] = m.max_position_embeddings;
  j["initializer_range"] = m.initializer_range;
  j["hidden_act"] = m.hidden_act;
  j["tie_word_embeddings"] = m.tie_word_embeddings;
  j["attention_bias"] = m.attention_bias;
  j["attention_dropout"] = m.attention_dropout;
  j["bos_token_id"] = optional_int(m.bos_token_id);
  j["eos_token_id"] = optional_int(m.eos_token_id);
  j["pad_token_id"] = optional_int(m.pad_token_id);
  j["num_nextn_predict_layers"] = m.num_nextn_predict_layers;
  j["bias_update_speed"] = m.bias_update_speed;
  j["mtp_loss_weight"] = m.mtp_loss_weight;
  return j.dump(2) + "\n";
}

std::vector<std::string> model_changes(const std::string& saved_json, const ModelConfig& m) {
  static const char* kNotCompared[] = {"initializer_range", "aux_loss_alpha",    "bias_update_speed",
                                       "mtp_loss_weight",   "attention_dropout", "bos_token_id",
                                       "eos_token_id",      "pad_token_id",      "architectures"};
  const auto skipped = [](const std::string& k) {
    for (const char* n : kNotCompared)
      if (k == n) return true;
    return false;
  };
  Json saved;
  try {
    saved = Json::parse(saved_json);
  } catch (const std::exception&) {
    return {"hf_config: the checkpoint's model config cannot be read"};
  }
  if (!saved.is_object()) return {"hf_config: the checkpoint's model config is not a JSON object"};
  const Json now = Json::parse(to_hf_config_json(m));
  std::vector<std::string> out;
  const auto text = [](const Json& v) {
    const std::string s = v.dump();
    return s.size() <= 80 ? s : s.substr(0, 80) + "...";
  };
  for (const auto& [key, value] : now.items()) {
    if (skipped(key)) continue;
    const auto it = saved.find(key);
    if (it == saved.end()) continue;  // a key newer than the checkpoint: its default then
    if (*it != value) out.push_back(fmt::format("model.{} {} in the checkpoint, {} here", key, text(*it), text(value)));
  }
  return out;
}

ModelConfig model_from_hf_config(const std::string& json_text, const std::string& file,
                                 std::vector<std::string>* ignored) {
  const auto fail = [&](const std::string& what) { return ConfigError(fmt::format("{}: {}", file, what)); };
  Json hf;
  try {
    hf = Json::parse(json_text);
  } catch (const std::exception&) {
    throw fail("not valid JSON");
  }
  if (!hf.is_object()) throw fail("not a JSON object");
  const auto type = hf.find("model_type");
  if (type == hf.end() || !type->is_string() || (*type != "deepseek_v2" && *type != "deepseek_v3"))
    throw fail(fmt::format("model_type {}: dstrain trains DeepSeek-V2 / V3 models; valid: deepseek_v2, deepseek_v3",
                           type == hf.end() ? "missing" : type->dump()));
  // (a quantization_config is listed as ignored: the tensors say whether the weights are FP8)
  // DeepSeek-V2's routing when a V2 config leaves it out (transformers' DeepseekV2Config has no
  // scoring_func, for one): dstrain's defaults are V3's.
  if (*type == "deepseek_v2") {
    const Json v2 = {{"scoring_func", "softmax"}, {"topk_method", "greedy"}, {"norm_topk_prob", false},
                     {"routed_scaling_factor", 1.0}, {"n_group", 1}, {"topk_group", 1}};
    for (const auto& [key, value] : v2.items())
      if (!hf.contains(key) || hf[key].is_null()) hf[key] = value;
  }
  // The keys dstrain's model has are those to_hf_config_json writes; rope_scaling's likewise.
  const Json known = Json::parse(to_hf_config_json(ModelConfig{}));
  static const char* kRopeKeys[] = {"type", "factor", "original_max_position_embeddings", "beta_fast",
                                    "beta_slow", "mscale", "mscale_all_dim"};
  // transformers 5 writes RoPE as rope_parameters {rope_theta, rope_type, and YaRN's keys}; the
  // DeepSeek releases as rope_theta and rope_scaling.
  if (const auto rp = hf.find("rope_parameters"); rp != hf.end() && rp->is_object()) {
    Json params = *rp;
    if (params.contains("rope_theta") && !hf.contains("rope_theta")) hf["rope_theta"] = params["rope_theta"];
    params.erase("rope_theta");
    const std::string rope_type = params.value("rope_type", params.value("type", std::string("default")));
    if (rope_type != "default" && (!hf.contains("rope_scaling") || hf["rope_scaling"].is_null()))
      hf["rope_scaling"] = params;
    hf.erase("rope_parameters");
  }
  Json kept = Json::object();
  for (const auto& [key, value] : hf.items()) {
    if (!known.contains(key)) {
      if (ignored) ignored->push_back(key);
      continue;
    }
    if (key != "rope_scaling" || !value.is_object()) {
      kept[key] = value;
      continue;
    }
    Json rope = Json::object();
    for (const auto& [k, v] : value.items()) {
      const std::string name = k == "rope_type" ? "type" : k;  // newer transformers write rope_type
      bool have = false;
      for (const char* r : kRopeKeys) have = have || name == r;
      if (have) rope[name] = v;
      else if (ignored) ignored->push_back("rope_scaling." + k);
    }
    kept[key] = rope;
  }
  // JSON is YAML: the kept keys become the model section of a config that checks them as a
  // YAML file's would (types, ranges, the model's consistency).
  const std::string text = "train_batch_size: 1\ntrain_micro_batch_size_per_gpu: 1\nseq_length: 1\nmodel: " +
                           kept.dump() + "\n";
  return load_config_text(text, file).model;
}

}  // namespace dstrain::config
