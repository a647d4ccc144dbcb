// The model section as a Hugging Face config.json (MODEL.md §2 fields, §12 exchange format).
#include <charconv>
#include <string>

#include "engine/config/load_config.h"

namespace dstrain::config {
namespace {

class Json {
 public:
  void key(const std::string& k) {
    out_ += first_ ? "\n  " : ",\n  ";
    first_ = false;
    out_ += "\"" + k + "\": ";
  }
  void num(const std::string& k, double v) {
    key(k);
    char buf[64];
    auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
    std::string s(buf, p);
    if (s.find_first_of(".en") == std::string::npos) s += ".0";
    out_ += s;
  }
  void integer(const std::string& k, int64_t v) { key(k), out_ += std::to_string(v); }
  void integer(const std::string& k, const std::optional<int64_t>& v) {
    key(k), out_ += v ? std::to_string(*v) : "null";
  }
  void boolean(const std::string& k, bool v) { key(k), out_ += v ? "true" : "false"; }
  void str(const std::string& k, const std::string& v) { key(k), out_ += "\"" + v + "\""; }
  void raw(const std::string& k, const std::string& v) { key(k), out_ += v; }
  std::string done() { return "{" + out_ + "\n}\n"; }

 private:
  std::string out_;
  bool first_ = true;
};

}  // namespace

std::string to_hf_config_json(const ModelConfig& m) {
  Json j;
  std::string arch = "[";
  const std::vector<std::string> names =
      m.architectures.empty()
          ? std::vector<std::string>{m.model_type == "deepseek_v2" ? "DeepseekV2ForCausalLM"
                                                                   : "DeepseekV3ForCausalLM"}
          : m.architectures;
  for (size_t i = 0; i < names.size(); ++i) arch += (i ? ", \"" : "\"") + names[i] + "\"";
  j.raw("architectures", arch + "]");
  j.str("model_type", m.model_type);
  j.integer("vocab_size", m.vocab_size);
  j.integer("hidden_size", m.hidden_size);
  j.integer("intermediate_size", m.intermediate_size);
  j.integer("moe_intermediate_size", m.moe_intermediate_size);
  j.integer("num_hidden_layers", m.num_hidden_layers);
  j.integer("num_attention_heads", m.num_attention_heads);
  j.integer("num_key_value_heads", m.num_key_value_heads);
  j.integer("q_lora_rank", m.q_lora_rank);
  j.integer("kv_lora_rank", m.kv_lora_rank);
  j.integer("qk_nope_head_dim", m.qk_nope_head_dim);
  j.integer("qk_rope_head_dim", m.qk_rope_head_dim);
  j.integer("v_head_dim", m.v_head_dim);
  j.integer("n_routed_experts", m.n_routed_experts);
  j.integer("n_shared_experts", m.n_shared_experts);
  j.integer("num_experts_per_tok", m.num_experts_per_tok);
  j.integer("first_k_dense_replace", m.first_k_dense_replace);
  j.integer("moe_layer_freq", m.moe_layer_freq);
  j.str("scoring_func", m.scoring_func);
  j.str("topk_method", m.topk_method);
  j.integer("n_group", m.n_group);
  j.integer("topk_group", m.topk_group);
  j.boolean("norm_topk_prob", m.norm_topk_prob);
  j.num("routed_scaling_factor", m.routed_scaling_factor);
  j.num("aux_loss_alpha", m.aux_loss_alpha);
  j.boolean("seq_aux", m.seq_aux);
  j.num("rms_norm_eps", m.rms_norm_eps);
  j.num("rope_theta", m.rope_theta);
  if (m.rope_scaling) {
    Json r;
    r.str("type", m.rope_scaling->type);
    r.num("factor", m.rope_scaling->factor);
    r.integer("original_max_position_embeddings", m.rope_scaling->original_max_position_embeddings);
    r.num("beta_fast", m.rope_scaling->beta_fast);
    r.num("beta_slow", m.rope_scaling->beta_slow);
    r.num("mscale", m.rope_scaling->mscale);
    r.num("mscale_all_dim", m.rope_scaling->mscale_all_dim);
    std::string text = r.done();
    text.pop_back();  // trailing newline
    j.raw("rope_scaling", text);
  } else {
    j.raw("rope_scaling", "null");
  }
  j.boolean("rope_interleave", m.rope_interleave);
  j.integer("max_position_embeddings", m.max_position_embeddings);
  j.num("initializer_range", m.initializer_range);
  j.str("hidden_act", m.hidden_act);
  j.boolean("tie_word_embeddings", m.tie_word_embeddings);
  j.boolean("attention_bias", m.attention_bias);
  j.num("attention_dropout", m.attention_dropout);
  j.integer("bos_token_id", m.bos_token_id);
  j.integer("eos_token_id", m.eos_token_id);
  j.integer("pad_token_id", m.pad_token_id);
  j.integer("num_nextn_predict_layers", m.num_nextn_predict_layers);
  j.num("bias_update_speed", m.bias_update_speed);
  j.num("mtp_loss_weight", m.mtp_loss_weight);
  return j.done();
}

}  // namespace dstrain::config
