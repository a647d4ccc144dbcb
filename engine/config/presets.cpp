#include "engine/config/presets.h"

#include "engine/common/error.h"
#include "engine/common/strings.h"

namespace dstrain::config {
namespace {

// The three dstrain presets share everything but the sizes (docs/model.md §9.2).
ModelConfig dstrain_base() {
  ModelConfig m;
  m.model_type = ModelType::kDeepseekV3;
  m.architectures = {"DeepseekV3ForCausalLM"};
  m.scoring_func = ScoringFunc::kSigmoid;
  m.topk_method = TopkMethod::kNoauxTc;
  m.norm_topk_prob = true;
  m.routed_scaling_factor = 2.5;
  m.rope_theta = 10000.0;
  m.rope_scaling.reset();
  m.rope_interleave = true;
  m.rms_norm_eps = 1e-6;
  m.initializer_range = 0.02;
  m.moe_layer_freq = 1;
  m.first_k_dense_replace = 1;
  m.seq_aux = true;
  m.tie_word_embeddings = false;
  m.attention_bias = false;
  m.num_nextn_predict_layers = 0;
  m.mtp_loss_weight = 0.3;
  m.bos_token_id.reset();
  m.eos_token_id.reset();
  return m;
}

ModelConfig tiny() {
  ModelConfig m = dstrain_base();
  m.preset = "tiny";
  m.vocab_size = 256;
  m.hidden_size = 64;
  m.num_hidden_layers = 2;
  m.num_attention_heads = m.num_key_value_heads = 4;
  m.q_lora_rank = 48;
  m.kv_lora_rank = 32;
  m.qk_nope_head_dim = 16;
  m.qk_rope_head_dim = 8;
  m.v_head_dim = 16;
  m.intermediate_size = 128;
  m.moe_intermediate_size = 32;
  m.n_routed_experts = 4;
  m.n_shared_experts = 1;
  m.num_experts_per_tok = 2;
  m.n_group = 2;
  m.topk_group = 2;
  m.aux_loss_alpha = 0.001;
  m.bias_update_speed = 0.001;
  m.max_position_embeddings = 512;
  return m;
}

ModelConfig small() {
  ModelConfig m = dstrain_base();
  m.preset = "small";
  m.vocab_size = 256;
  m.hidden_size = 256;
  m.num_hidden_layers = 4;
  m.num_attention_heads = m.num_key_value_heads = 4;
  m.q_lora_rank = 96;
  m.kv_lora_rank = 64;
  m.qk_nope_head_dim = 32;
  m.qk_rope_head_dim = 16;
  m.v_head_dim = 32;
  m.intermediate_size = 768;
  m.moe_intermediate_size = 192;
  m.n_routed_experts = 32;
  m.n_shared_experts = 1;
  m.num_experts_per_tok = 4;
  m.n_group = 4;
  m.topk_group = 2;
  m.aux_loss_alpha = 0.0001;
  m.bias_update_speed = 0.01;
  m.max_position_embeddings = 1024;
  return m;
}

ModelConfig medium() {
  ModelConfig m = dstrain_base();
  m.preset = "medium";
  m.vocab_size = 8192;
  m.hidden_size = 768;
  m.num_hidden_layers = 12;
  m.num_attention_heads = m.num_key_value_heads = 12;
  m.q_lora_rank = 384;
  m.kv_lora_rank = 256;
  m.qk_nope_head_dim = 64;
  m.qk_rope_head_dim = 32;
  m.v_head_dim = 64;
  m.intermediate_size = 3072;
  m.moe_intermediate_size = 256;
  m.n_routed_experts = 32;
  m.n_shared_experts = 2;
  m.num_experts_per_tok = 6;
  m.n_group = 4;
  m.topk_group = 2;
  m.aux_loss_alpha = 0.0001;
  m.bias_update_speed = 0.01;
  m.max_position_embeddings = 4096;
  return m;
}

ModelConfig deepseek_v3() {
  ModelConfig m;  // the struct defaults are HF's DeepseekV3Config
  m.preset = "deepseek-v3";
  m.architectures = {"DeepseekV3ForCausalLM"};
  m.max_position_embeddings = 163840;
  RopeScaling yarn;
  yarn.factor = 40.0;
  yarn.original_max_position_embeddings = 4096;
  yarn.beta_fast = 32.0;
  yarn.beta_slow = 1.0;
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 1.0;
  m.rope_scaling = yarn;
  m.num_nextn_predict_layers = 1;
  m.bos_token_id = 0;
  m.eos_token_id = 1;
  return m;
}

ModelConfig deepseek_v2_lite() {
  ModelConfig m;
  m.preset = "deepseek-v2-lite";
  m.model_type = ModelType::kDeepseekV2;
  m.architectures = {"DeepseekV2ForCausalLM"};
  m.vocab_size = 102400;
  m.hidden_size = 2048;
  m.intermediate_size = 10944;
  m.moe_intermediate_size = 1408;
  m.num_hidden_layers = 27;
  m.num_attention_heads = m.num_key_value_heads = 16;
  m.q_lora_rank.reset();
  m.kv_lora_rank = 512;
  m.qk_nope_head_dim = 128;
  m.qk_rope_head_dim = 64;
  m.v_head_dim = 128;
  m.n_routed_experts = 64;
  m.n_shared_experts = 2;
  m.num_experts_per_tok = 6;
  m.n_group = 1;
  m.topk_group = 1;
  m.topk_method = TopkMethod::kGreedy;
  m.scoring_func = ScoringFunc::kSoftmax;
  m.norm_topk_prob = false;
  m.routed_scaling_factor = 1.0;
  m.first_k_dense_replace = 1;
  m.moe_layer_freq = 1;
  m.aux_loss_alpha = 0.001;
  m.seq_aux = true;
  m.max_position_embeddings = 163840;
  RopeScaling yarn;
  yarn.factor = 40.0;
  yarn.original_max_position_embeddings = 4096;
  yarn.beta_fast = 32.0;
  yarn.beta_slow = 1.0;
  yarn.mscale = 0.707;
  yarn.mscale_all_dim = 0.707;
  m.rope_scaling = yarn;
  m.bos_token_id = 100000;
  m.eos_token_id = 100001;
  return m;
}

}  // namespace

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = {"tiny", "small", "medium", "deepseek-v2-lite",
                                                 "deepseek-v3"};
  return names;
}

ModelConfig model_preset(const std::string& name) {
  if (name == "tiny") return tiny();
  if (name == "small") return small();
  if (name == "medium") return medium();
  if (name == "deepseek-v2-lite") return deepseek_v2_lite();
  if (name == "deepseek-v3") return deepseek_v3();
  throw ConfigError(fmt::format("unknown model preset '{}'; valid: {}", name,
                                join(preset_names(), ", ")));
}

}  // namespace dstrain::config
