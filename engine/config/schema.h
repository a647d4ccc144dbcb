// The config schema, written once. Each `describe` lists a section's keys with their types
// (from the struct member), defaults (the member's initial value) and valid values (a Check).
// The same functions drive the YAML reader (strict: unknown keys are errors), the writer behind
// `--print-config`, and the key list used for "did you mean" — so they cannot disagree.
//
// A visitor V provides:
//   field(key, member, check)        a scalar, optional scalar or list
//   section(key, member)             a nested mapping, always present
//   nullable_section(key, member)    a nested mapping or null (std::optional)
//   preset(key, model)               model.preset: replaces the whole section first
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/common/strings.h"
#include "engine/config/presets.h"
#include "engine/config/train_config.h"

namespace dstrain::config {

// A constraint on a value, with the phrase that tells a user what is valid.
template <class T>
struct Check {
  std::function<bool(const T&)> ok;
  std::string valid;
};

inline Check<int64_t> at_least(int64_t lo) {
  return {[lo](const int64_t& v) { return v >= lo; }, fmt::format("an integer >= {}", lo)};
}
inline Check<int64_t> int_range(int64_t lo, int64_t hi) {
  return {[lo, hi](const int64_t& v) { return v >= lo && v <= hi; },
          fmt::format("an integer from {} to {}", lo, hi)};
}
inline Check<double> non_negative() {
  return {[](const double& v) { return v >= 0.0; }, "a number >= 0"};
}
inline Check<double> positive() {
  return {[](const double& v) { return v > 0.0; }, "a number > 0"};
}
inline Check<double> real_range(double lo, double hi, bool hi_open = false) {
  return {[=](const double& v) { return v >= lo && (hi_open ? v < hi : v <= hi); },
          fmt::format("a number from {} to {}{}", lo, hi, hi_open ? " (exclusive)" : "")};
}
inline Check<std::string> one_of(std::vector<std::string> options) {
  std::string valid = join(options, ", ");
  return {[options = std::move(options)](const std::string& v) {
            for (const auto& o : options)
              if (v == o) return true;
            return false;
          },
          "one of " + valid};
}
inline Check<std::string> non_empty() {
  return {[](const std::string& v) { return !v.empty(); }, "a non-empty string"};
}

template <class V>
void describe(V& v, RopeScaling& c) {
  v.field("type", c.type, one_of({"yarn"}));
  v.field("factor", c.factor, positive());
  v.field("original_max_position_embeddings", c.original_max_position_embeddings, at_least(1));
  v.field("beta_fast", c.beta_fast, positive());
  v.field("beta_slow", c.beta_slow, positive());
  v.field("mscale", c.mscale, non_negative());
  v.field("mscale_all_dim", c.mscale_all_dim, non_negative());
}

template <class V>
void describe(V& v, ModelConfig& c) {
  v.preset("preset", c);
  v.field("model_type", c.model_type);
  v.field("architectures", c.architectures);
  v.field("vocab_size", c.vocab_size, at_least(2));
  v.field("hidden_size", c.hidden_size, at_least(1));
  v.field("intermediate_size", c.intermediate_size, at_least(1));
  v.field("moe_intermediate_size", c.moe_intermediate_size, at_least(1));
  v.field("num_hidden_layers", c.num_hidden_layers, at_least(1));
  v.field("num_attention_heads", c.num_attention_heads, at_least(1));
  v.field("num_key_value_heads", c.num_key_value_heads, at_least(1));
  v.field("q_lora_rank", c.q_lora_rank, at_least(1));
  v.field("kv_lora_rank", c.kv_lora_rank, at_least(1));
  v.field("qk_nope_head_dim", c.qk_nope_head_dim, at_least(1));
  v.field("qk_rope_head_dim", c.qk_rope_head_dim, at_least(2));
  v.field("v_head_dim", c.v_head_dim, at_least(1));
  v.field("n_routed_experts", c.n_routed_experts, at_least(1));
  v.field("n_shared_experts", c.n_shared_experts, at_least(0));
  v.field("num_experts_per_tok", c.num_experts_per_tok, at_least(1));
  v.field("first_k_dense_replace", c.first_k_dense_replace, at_least(0));
  v.field("moe_layer_freq", c.moe_layer_freq, at_least(1));
  v.field("scoring_func", c.scoring_func);
  v.field("topk_method", c.topk_method);
  v.field("n_group", c.n_group, at_least(1));
  v.field("topk_group", c.topk_group, at_least(1));
  v.field("norm_topk_prob", c.norm_topk_prob);
  v.field("routed_scaling_factor", c.routed_scaling_factor, positive());
  v.field("aux_loss_alpha", c.aux_loss_alpha, non_negative());
  v.field("seq_aux", c.seq_aux);
  v.field("rms_norm_eps", c.rms_norm_eps, positive());
  v.field("rope_theta", c.rope_theta, positive());
  v.nullable_section("rope_scaling", c.rope_scaling);
  v.field("rope_interleave", c.rope_interleave);
  v.field("max_position_embeddings", c.max_position_embeddings, at_least(1));
  v.field("initializer_range", c.initializer_range, positive());
  v.field("hidden_act", c.hidden_act, one_of({"silu"}));
  v.field("tie_word_embeddings", c.tie_word_embeddings);
  v.field("attention_bias", c.attention_bias);
  v.field("attention_dropout", c.attention_dropout, real_range(0.0, 0.0));
  v.field("bos_token_id", c.bos_token_id, at_least(0));
  v.field("eos_token_id", c.eos_token_id, at_least(0));
  v.field("pad_token_id", c.pad_token_id, at_least(0));
  v.field("num_nextn_predict_layers", c.num_nextn_predict_layers, at_least(0));
  v.field("bias_update_speed", c.bias_update_speed, non_negative());
  v.field("mtp_loss_weight", c.mtp_loss_weight, non_negative());
}

template <class V>
void describe(V& v, ParallelConfig& c) {
  v.field("tensor", c.tensor, at_least(1));
  v.field("pipeline", c.pipeline, at_least(1));
  v.field("expert", c.expert, at_least(1));
  v.field("data", c.data);
  v.field("stage_layers", c.stage_layers, at_least(1));
  v.field("comm_timeout_s", c.comm_timeout_s, real_range(0.1, 1e7));
  v.field("sequence_parallel", c.sequence_parallel);
  v.field("pipeline_schedule", c.pipeline_schedule);
  v.field("virtual_stages", c.virtual_stages, at_least(1));
}

template <class V>
void describe(V& v, Fp16Config& c) {
  v.field("enabled", c.enabled);
  v.field("loss_scale", c.loss_scale, non_negative());
  v.field("initial_scale_power", c.initial_scale_power, int_range(0, 62));
  v.field("loss_scale_window", c.loss_scale_window, at_least(1));
  v.field("hysteresis", c.hysteresis, at_least(1));
  v.field("consecutive_hysteresis", c.consecutive_hysteresis);
  v.field("min_loss_scale", c.min_loss_scale, positive());
}

template <class V>
void describe(V& v, Bf16Config& c) {
  v.field("enabled", c.enabled);
}

template <class V>
void describe(V& v, ZeroConfig& c) {
  v.field("stage", c.stage, int_range(0, 2));
  v.field("overlap_comm", c.overlap_comm);
  v.field("reduce_bucket_size", c.reduce_bucket_size, at_least(1024));
  v.field("allgather_bucket_size", c.allgather_bucket_size, at_least(1024));
}

template <class V>
void describe(V& v, GradientCompressionConfig& c) {
  v.field("type", c.type, one_of({"powersgd"}));
  v.field("rank", c.rank, at_least(1));
  v.field("start_iter", c.start_iter, at_least(0));
  v.field("min_compression_rate", c.min_compression_rate, non_negative());
  v.field("use_error_feedback", c.use_error_feedback);
  v.field("warm_start", c.warm_start);
}

template <class V>
void describe(V& v, OptimizerParams& c) {
  v.field("lr", c.lr, non_negative());
  v.field("betas", c.betas, real_range(0.0, 1.0, true));
  v.field("eps", c.eps, positive());
  v.field("weight_decay", c.weight_decay, non_negative());
  v.field("adam_w_mode", c.adam_w_mode);
}

template <class V>
void describe(V& v, OptimizerConfig& c) {
  v.field("type", c.type);
  v.section("params", c.params);
}

// Scheduler params depend on the scheduler type (read before params), as in DeepSpeed.
template <class V>
void describe_scheduler_params(V& v, SchedulerParams& c, SchedulerType type) {
  using enum SchedulerType;
  if (type == kWarmupLR || type == kWarmupDecayLR) {
    v.field("warmup_min_lr", c.warmup_min_lr, non_negative());
    v.field("warmup_max_lr", c.warmup_max_lr, non_negative());
  }
  if (type == kWarmupCosineLR) v.field("warmup_min_ratio", c.warmup_min_ratio, real_range(0, 1));
  v.field("warmup_num_steps", c.warmup_num_steps, at_least(0));
  v.field("warmup_type", c.warmup_type);
  if (type == kWarmupDecayLR || type == kWarmupCosineLR)
    v.field("total_num_steps", c.total_num_steps, at_least(1));
  if (type == kWarmupCosineLR) v.field("cos_min_ratio", c.cos_min_ratio, real_range(0, 1));
}

template <class V>
void describe(V& v, SchedulerConfig& c) {
  v.field("type", c.type);
  v.section_with("params", [&](V& sub) { describe_scheduler_params(sub, c.params, c.type); });
}

template <class V>
void describe(V& v, ActivationCheckpointingConfig& c) {
  v.field("enabled", c.enabled);
  v.field("granularity", c.granularity);
  v.field("num_layers", c.num_layers, at_least(0));
}

template <class V>
void describe(V& v, DataConfig& c) {
  v.field("path", c.path, non_empty());
  v.field("paths", c.paths);
  v.field("format", c.format);
  v.field("validation_fraction", c.validation_fraction, real_range(0.0, 0.5));
  v.field("eval_interval", c.eval_interval, at_least(0));
  v.field("eval_iters", c.eval_iters, at_least(1));
}

template <class V>
void describe(V& v, CheckpointConfig& c) {
  v.field("dir", c.dir, non_empty());
  v.field("interval", c.interval, at_least(0));
  v.field("save_at_end", c.save_at_end);
  v.field("keep_last", c.keep_last, at_least(1));
  v.field("resume", c.resume, non_empty());
  v.field("async", c.async);
  v.field("allow_data_change", c.allow_data_change);
  v.field("allow_model_change", c.allow_model_change);
}

template <class V>
void describe(V& v, MonitorConfig& c) {
  v.field("metrics_file", c.metrics_file);
  v.field("tensorboard", c.tensorboard);
  v.field("log_level", c.log_level, one_of({"trace", "debug", "info", "warn", "error", "off"}));
  v.field("expert_stats_interval", c.expert_stats_interval, at_least(0));
  v.field("peak_tflops", c.peak_tflops, non_negative());
  v.field("comm_log", c.comm_log);
  v.field("trace", c.trace);
  v.field("trace_steps", c.trace_steps, at_least(1));
  v.field("op_breakdown", c.op_breakdown);
}

template <class V>
void describe(V& v, KernelsConfig& c) {
  v.field("lowp_gemm", c.lowp_gemm, one_of({"auto", "native", "widened"}));
  v.field("cpu_dense_gemm", c.cpu_dense_gemm, one_of({"auto", "amx", "onednn"}));
  v.field("cpu_grouped_gemm", c.cpu_grouped_gemm, one_of({"auto", "amx", "onednn"}));
  v.field("cpu_attention", c.cpu_attention, one_of({"auto", "amx", "onednn"}));
  v.field("cuda_attention", c.cuda_attention, one_of({"tiled", "rows", "cudnn"}));
  v.field("cuda_grouped_gemm", c.cuda_grouped_gemm, one_of({"grouped", "loop"}));
  v.field("cuda_poison", c.cuda_poison);
  v.field("loss_chunk_tokens", c.loss_chunk_tokens, at_least(0));
}

template <class V>
void describe(V& v, TrainConfig& c) {
  v.field("train_batch_size", c.train_batch_size, at_least(1));
  v.field("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  v.field("gradient_accumulation_steps", c.gradient_accumulation_steps, at_least(1));
  v.field("memory_budget_gib", c.memory_budget_gib, positive());
  v.field("seq_length", c.seq_length, at_least(1));
  v.field("train_steps", c.train_steps, at_least(1));
  v.field("seed", c.seed, at_least(0));
  v.field("device", c.device);
  v.field("gradient_clipping", c.gradient_clipping, non_negative());
  v.field("steps_per_print", c.steps_per_print, at_least(1));
  v.field("wall_clock_breakdown", c.wall_clock_breakdown);
  v.section("fp16", c.fp16);
  v.section("bf16", c.bf16);
  v.field("communication_data_type", c.communication_data_type);
  v.section("zero_optimization", c.zero_optimization);
  v.nullable_section("gradient_compression", c.gradient_compression);
  v.section("optimizer", c.optimizer);
  v.nullable_section("scheduler", c.scheduler);
  v.section("activation_checkpointing", c.activation_checkpointing);
  v.section("model", c.model);
  v.section("parallel", c.parallel);
  v.section("data", c.data);
  v.section("checkpoint", c.checkpoint);
  v.section("monitor", c.monitor);
  v.section("kernels", c.kernels);
}

}  // namespace dstrain::config
