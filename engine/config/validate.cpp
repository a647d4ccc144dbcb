// Cross-key checks that do not depend on the world size, and defaults that depend on other keys.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <fmt/ranges.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/config/load_config.h"

namespace dstrain::config {

const char* to_string(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

Precision TrainConfig::precision() const {
  if (bf16.enabled) return Precision::kBf16;
  if (fp16.enabled) return Precision::kFp16;
  return Precision::kFp32;
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  return n_routed_experts.has_value() && layer >= first_k_dense_replace &&
         layer % moe_layer_freq == 0;
}

namespace {

std::string divisors_of(int64_t n) {
  std::vector<std::string> d;
  for (int64_t i = 1; i <= n && d.size() < 12; ++i)
    if (n % i == 0) d.push_back(std::to_string(i));
  return join(d, ", ") + (d.size() == 12 ? ", ..." : "");
}

void validate_router(const TrainConfig& cfg) {
  const ModelConfig& m = cfg.model;
  if (!m.n_routed_experts) return;
  const int64_t E = *m.n_routed_experts;
  if (m.num_experts_per_tok > E)
    fail_at(cfg, "model.num_experts_per_tok",
            fmt::format("{} experts per token but only {} routed experts (model.n_routed_experts); "
                        "valid: 1 to {}",
                        m.num_experts_per_tok, E, E));
  if (E % m.n_group != 0)
    fail_at(cfg, "model.n_group",
            fmt::format("{} groups do not divide model.n_routed_experts = {}; valid: a divisor of "
                        "{}: {}",
                        m.n_group, E, E, divisors_of(E)));
  if (m.topk_group > m.n_group)
    fail_at(cfg, "model.topk_group",
            fmt::format("{} is more than model.n_group = {}; valid: 1 to {}", m.topk_group,
                        m.n_group, m.n_group));
  const int64_t per_group = E / m.n_group;
  if (m.topk_method == TopkMethod::kNoauxTc && per_group < 2)
    fail_at(cfg, "model.n_group",
            fmt::format("noaux_tc scores a group by its two best experts, but {} groups of {} "
                        "experts leave {} per group; valid: n_group <= {}",
                        m.n_group, E, per_group, E / 2));
  if (m.topk_method != TopkMethod::kGreedy && m.num_experts_per_tok > m.topk_group * per_group)
    fail_at(cfg, "model.num_experts_per_tok",
            fmt::format("{} experts per token cannot be picked from {} groups of {} experts "
                        "(model.topk_group x experts per group = {}); valid: at most {}",
                        m.num_experts_per_tok, m.topk_group, per_group, m.topk_group * per_group,
                        m.topk_group * per_group));
  if (m.model_type == ModelType::kDeepseekV3 &&
      (m.scoring_func != ScoringFunc::kSigmoid || m.topk_method != TopkMethod::kNoauxTc))
    fail_at(cfg, m.scoring_func != ScoringFunc::kSigmoid ? "model.scoring_func" : "model.topk_method",
            fmt::format("model_type deepseek_v3 routes with scoring_func sigmoid and topk_method "
                        "noaux_tc (got {} / {}), as Hugging Face's DeepseekV3 does; valid: those, "
                        "or model_type deepseek_v2 for softmax routing",
                        to_string(m.scoring_func), to_string(m.topk_method)));
  if (m.model_type == ModelType::kDeepseekV2 &&
      (m.scoring_func != ScoringFunc::kSoftmax || m.topk_method == TopkMethod::kNoauxTc))
    fail_at(cfg, m.scoring_func != ScoringFunc::kSoftmax ? "model.scoring_func" : "model.topk_method",
            fmt::format("model_type deepseek_v2 routes with scoring_func softmax and topk_method "
                        "greedy or group_limited_greedy (got {} / {}); valid: those, or model_type "
                        "deepseek_v3 for sigmoid noaux_tc routing",
                        to_string(m.scoring_func), to_string(m.topk_method)));
}

// Every integer size of the model, and of the batch, at most 2^24 (sixteen million;
// DeepSeek-V3's largest, its vocabulary, is 129,280): the plan multiplies at most two of the
// model's into a tensor dimension (plan/param_table.cpp), which so stays below 2^50, far from
// where int64 wraps, and checks the products of dimensions in floating point
// (plan/parallel_plan.cpp check_sizes); the batch's products, with the data-parallel size, are
// checked for overflow where they are formed (plan/batch_plan.cpp).
constexpr int64_t kMaxModelSize = int64_t(1) << 24;

void check_model_sizes(const TrainConfig& cfg) {
  const ModelConfig& m = cfg.model;
  const std::vector<std::pair<const char*, std::optional<int64_t>>> sizes = {
      {"model.vocab_size", m.vocab_size},
      {"model.hidden_size", m.hidden_size},
      {"model.intermediate_size", m.intermediate_size},
      {"model.moe_intermediate_size", m.moe_intermediate_size},
      {"model.num_hidden_layers", m.num_hidden_layers},
      {"model.num_attention_heads", m.num_attention_heads},
      {"model.num_key_value_heads", m.num_key_value_heads},
      {"model.q_lora_rank", m.q_lora_rank},
      {"model.kv_lora_rank", m.kv_lora_rank},
      {"model.qk_nope_head_dim", m.qk_nope_head_dim},
      {"model.qk_rope_head_dim", m.qk_rope_head_dim},
      {"model.v_head_dim", m.v_head_dim},
      {"model.n_routed_experts", m.n_routed_experts},
      {"model.n_shared_experts", m.n_shared_experts},
      {"model.num_experts_per_tok", m.num_experts_per_tok},
      {"model.first_k_dense_replace", m.first_k_dense_replace},
      {"model.moe_layer_freq", m.moe_layer_freq},
      {"model.n_group", m.n_group},
      {"model.topk_group", m.topk_group},
      {"model.max_position_embeddings", m.max_position_embeddings},
      {"model.num_nextn_predict_layers", m.num_nextn_predict_layers},
      {"seq_length", cfg.seq_length},
      {"train_batch_size", cfg.train_batch_size},
      {"train_micro_batch_size_per_gpu",
       cfg.train_micro_batch_size_per_gpu && !cfg.train_micro_batch_size_per_gpu->is_auto()
           ? std::optional<int64_t>(cfg.train_micro_batch_size_per_gpu->value)
           : std::nullopt},
      {"gradient_accumulation_steps", cfg.gradient_accumulation_steps}};
  for (const auto& [key, value] : sizes)
    if (value && *value > kMaxModelSize)
      fail_at(cfg, key,
              fmt::format("{} is more than the {} a {} size may be (the plan's 64-bit counts must not wrap); "
                          "valid: 1 to {}",
                          *value, with_commas(kMaxModelSize),
                          std::string(key).find("batch") != std::string::npos ||
                                  std::string(key) == "gradient_accumulation_steps"
                              ? "batch"
                              : "model",
                          with_commas(kMaxModelSize)));
}

void validate_model(const TrainConfig& cfg) {
  check_model_sizes(cfg);
  const ModelConfig& m = cfg.model;
  if (m.num_key_value_heads != m.num_attention_heads)
    fail_at(cfg, "model.num_key_value_heads",
            fmt::format("{} differs from model.num_attention_heads = {}; MLA has no grouped KV "
                        "heads; valid: {}",
                        m.num_key_value_heads, m.num_attention_heads, m.num_attention_heads));
  if (m.qk_rope_head_dim % 2 != 0)
    fail_at(cfg, "model.qk_rope_head_dim",
            fmt::format("{} is odd; RoPE rotates pairs; valid: an even integer >= 2",
                        m.qk_rope_head_dim));
  if (m.tie_word_embeddings)
    fail_at(cfg, "model.tie_word_embeddings",
            "true, but DeepSeek models keep lm_head untied from embed_tokens; valid: false");
  if (m.first_k_dense_replace > m.num_hidden_layers)
    fail_at(cfg, "model.first_k_dense_replace",
            fmt::format("{} dense layers requested but the model has {} layers "
                        "(model.num_hidden_layers); valid: 0 to {}",
                        m.first_k_dense_replace, m.num_hidden_layers, m.num_hidden_layers));
  if (m.num_nextn_predict_layers > 0 && !m.n_routed_experts && m.first_k_dense_replace == 0)
    fail_at(cfg, "model.num_nextn_predict_layers", "MTP needs a decoder layer definition");
  if (cfg.seq_length > m.max_position_embeddings)
    fail_at(cfg, "seq_length",
            fmt::format("{} is longer than model.max_position_embeddings = {}; valid: 1 to {}",
                        cfg.seq_length, m.max_position_embeddings, m.max_position_embeddings));
  validate_router(cfg);
}

void validate_parallel(const TrainConfig& cfg) {
  const ModelConfig& m = cfg.model;
  const ParallelConfig& p = cfg.parallel;
  const auto tp_divides = [&](int64_t n, const char* what) {
    if (n % p.tensor != 0)
      fail_at(cfg, "parallel.tensor",
              fmt::format("{} does not divide {} = {}; valid: a divisor of {}: {}", p.tensor, what,
                          n, n, divisors_of(n)));
  };
  tp_divides(m.num_attention_heads, "model.num_attention_heads");
  // The vocabulary is split in blocks of ceil(V / tp) rows (a remainder is padding that exists
  // nowhere): every rank must hold at least one real row.
  const auto leaves_a_rank_empty = [&](int64_t tp) { return (tp - 1) * ((m.vocab_size + tp - 1) / tp) >= m.vocab_size; };
  if (leaves_a_rank_empty(p.tensor)) {
    int64_t most = p.tensor;
    while (most > 1 && leaves_a_rank_empty(most)) --most;
    fail_at(cfg, "parallel.tensor",
            fmt::format("{} splits model.vocab_size = {} into blocks of {} rows, leaving the last rank none; valid: "
                        "at most {}",
                        p.tensor, m.vocab_size, (m.vocab_size + p.tensor - 1) / p.tensor, most));
  }
  if (p.sequence_parallel && cfg.seq_length % p.tensor != 0)
    fail_at(cfg, "parallel.sequence_parallel",
            fmt::format("true, but seq_length {} is not divisible by parallel.tensor {}: sequence parallelism "
                        "splits every sequence's tokens over the tensor-parallel ranks; valid: a seq_length "
                        "that is a multiple of {}, or false",
                        cfg.seq_length, p.tensor, p.tensor));
  if (m.first_k_dense_replace > 0 || !m.n_routed_experts)
    tp_divides(m.intermediate_size, "model.intermediate_size");
  if (m.n_routed_experts && m.num_shared() > 0)
    tp_divides(m.num_shared() * m.moe_intermediate_size,
               "the shared-expert width (n_shared_experts x moe_intermediate_size)");
  if (p.pipeline > m.num_hidden_layers)
    fail_at(cfg, "parallel.pipeline",
            fmt::format("{} pipeline stages but the model has only {} layers "
                        "(model.num_hidden_layers); valid: 1 to {}",
                        p.pipeline, m.num_hidden_layers, m.num_hidden_layers));
  if (p.virtual_stages > 1 && p.pipeline_schedule != PipelineScheduleKind::kInterleaved)
    fail_at(cfg, "parallel.virtual_stages",
            fmt::format("{} model chunks per pipeline rank, but parallel.pipeline_schedule is {}; valid: 1, or set "
                        "parallel.pipeline_schedule: interleaved",
                        p.virtual_stages, to_string(p.pipeline_schedule)));
  if (p.virtual_stages > 1 && p.pipeline < 2)
    fail_at(cfg, "parallel.virtual_stages",
            fmt::format("{} model chunks per rank with one pipeline stage: interleaving needs parallel.pipeline >= "
                        "2; valid: 1",
                        p.virtual_stages));
  if (p.pipeline * p.virtual_stages > m.num_hidden_layers)
    fail_at(cfg, "parallel.virtual_stages",
            fmt::format("{} pipeline stages x {} chunks = {} virtual stages but the model has only {} layers "
                        "(model.num_hidden_layers); valid: at most {} chunks",
                        p.pipeline, p.virtual_stages, p.pipeline * p.virtual_stages, m.num_hidden_layers,
                        m.num_hidden_layers / p.pipeline));
  if (const auto& ac = cfg.activation_checkpointing; ac.num_layers && *ac.num_layers > m.num_hidden_layers)
    fail_at(cfg, "activation_checkpointing.num_layers",
            fmt::format("{} recomputed layers per stage but the model has only {} (model.num_hidden_layers); valid: 0 "
                        "to {}, or null for all",
                        *ac.num_layers, m.num_hidden_layers, m.num_hidden_layers));
  if (p.expert > 1 && !m.n_routed_experts)
    fail_at(cfg, "parallel.expert",
            fmt::format("{}, but the model has no routed experts (model.n_routed_experts is null); "
                        "valid: 1",
                        p.expert));
  if (m.n_routed_experts && *m.n_routed_experts % p.expert != 0)
    fail_at(cfg, "parallel.expert",
            fmt::format("{} does not divide model.n_routed_experts = {}; valid: a divisor of {}: {}",
                        p.expert, *m.n_routed_experts, *m.n_routed_experts,
                        divisors_of(*m.n_routed_experts)));
  if (!p.data.is_auto() && p.data.value % p.expert != 0)
    fail_at(cfg, "parallel.expert",
            fmt::format("{} does not divide parallel.data = {}: expert parallelism splits the "
                        "data-parallel ranks; valid: a divisor of {}: {}",
                        p.expert, p.data.value, p.data.value, divisors_of(p.data.value)));
  if (!p.stage_layers.empty()) {
    if (static_cast<int64_t>(p.stage_layers.size()) != p.pipeline * p.virtual_stages)
      fail_at(cfg, "parallel.stage_layers",
              fmt::format("{} entries for {} pipeline stages{}; valid: one layer count per stage",
                          p.stage_layers.size(), p.pipeline * p.virtual_stages,
                          p.virtual_stages > 1 ? fmt::format(" (parallel.pipeline {} x parallel.virtual_stages {})",
                                                             p.pipeline, p.virtual_stages)
                                               : std::string(" (parallel.pipeline)")));
    const int64_t sum = std::accumulate(p.stage_layers.begin(), p.stage_layers.end(), int64_t{0});
    if (sum != m.num_hidden_layers)
      fail_at(cfg, "parallel.stage_layers",
              fmt::format("the counts add up to {} layers but the model has {} "
                          "(model.num_hidden_layers); valid: counts >= 1 that sum to {}",
                          sum, m.num_hidden_layers, m.num_hidden_layers));
  }
}

// One data file checked against its format: the configured one, or under auto the file's own
// (a Megatron prefix by its .idx / .bin, a dstrain-prep dataset by the HDF5 signature, else
// text). Errors name `key`.
DataFormat resolve_data_format(const TrainConfig& cfg, const char* key, const std::string& path, DataFormat format) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // Megatron-LM's indexed dataset: the path is its prefix (or either file); both files must exist.
  if (format == DataFormat::kMegatron || (format == DataFormat::kAuto && is_megatron_path(path))) {
    const std::string prefix = megatron_prefix(path);
    for (const char* ext : {".idx", ".bin"})
      if (!fs::is_regular_file(prefix + ext, ec))
        fail_at(cfg, key,
                fmt::format("'{}{}' is not a readable file (working directory {}); valid: the prefix of a Megatron "
                            "dataset whose .idx and .bin files exist",
                            prefix, ext, fs::current_path(ec).string()));
    return DataFormat::kMegatron;
  }
  if (!fs::is_regular_file(path, ec))
    fail_at(cfg, key,
            fmt::format("'{}' is not a readable file (working directory {}); valid: the path of "
                        "the training data",
                        path, fs::current_path(ec).string()));
  if (fs::file_size(path, ec) == 0)
    fail_at(cfg, key, fmt::format("'{}' is empty; valid: a file with training data", path));
  const bool hdf5 = is_hdf5_file(path);  // a dstrain-prep dataset: its signature tells it from text
  if (format == DataFormat::kAuto) return hdf5 ? DataFormat::kTokens : DataFormat::kText;
  if (format == DataFormat::kText && hdf5)
    fail_at(cfg, "data.format",
            fmt::format("text, but '{}' is an HDF5 file (a dstrain-prep token dataset?): training on its "
                        "bytes would be nonsense; valid: tokens, or auto",
                        path));
  if (format == DataFormat::kTokens && !hdf5)
    fail_at(cfg, "data.format",
            fmt::format("tokens, but '{}' is not an HDF5 file (dstrain-prep writes those); valid: text for "
                        "raw text, or auto",
                        path));
  return format;
}

void validate_training(TrainConfig& cfg) {
  const auto& ts = cfg.monitor.trace_steps;
  if (ts.size() != 2 || ts[0] > ts[1])
    fail_at(cfg, "monitor.trace_steps",
            fmt::format("[{}]: valid: [first, last] with 1 <= first <= last", fmt::join(ts, ", ")));
  if (cfg.fp16.enabled && cfg.bf16.enabled)
    fail_at(cfg, "bf16.enabled",
            "true while fp16.enabled is also true; valid: at most one of fp16 and bf16 enabled");
  if (cfg.optimizer.params.betas.size() != 2)
    fail_at(cfg, "optimizer.params.betas",
            fmt::format("{} values; valid: a list of two numbers in [0, 1), e.g. [0.9, 0.95]",
                        cfg.optimizer.params.betas.size()));
  if (cfg.scheduler && cfg.scheduler->type != SchedulerType::kWarmupLR) {
    SchedulerParams& s = cfg.scheduler->params;
    const bool given = s.total_num_steps.has_value();
    if (!given) s.total_num_steps = cfg.train_steps;  // a short run may end inside the warmup
    // (train_steps itself is what the default resolves to — a run that ends inside the warmup —
    // so a printed config, which writes the resolved value, loads again.)
    if (given && *s.total_num_steps < s.warmup_num_steps && *s.total_num_steps != cfg.train_steps)
      fail_at(cfg, "scheduler.params.total_num_steps",
              fmt::format("{} is fewer than scheduler.params.warmup_num_steps = {}; valid: an "
                          "integer >= {}, or train_steps ({})",
                          *s.total_num_steps, s.warmup_num_steps, s.warmup_num_steps, cfg.train_steps));
  }
  if (cfg.gradient_compression) {
    // (the resolved layout — world size, device — is checked where the engine is built)
    if (cfg.zero_optimization.stage >= 2)
      fail_at(cfg, "gradient_compression",
              fmt::format("powersgd with zero_optimization.stage {}: PowerSGD all-reduces low-rank factors of whole "
                          "gradients, which ZeRO-2 partitions; valid: zero_optimization.stage 0 or 1",
                          cfg.zero_optimization.stage));
    if (cfg.parallel.pipeline > 1)
      fail_at(cfg, "gradient_compression",
              fmt::format("powersgd with parallel.pipeline {}: compression is for data-parallel layouts without a "
                          "pipeline; valid: parallel.pipeline 1, or gradient_compression: null",
                          cfg.parallel.pipeline));
    if (cfg.communication_data_type && *cfg.communication_data_type != CommDataType::kFp32)
      fail_at(cfg, "gradient_compression",
              fmt::format("powersgd with communication_data_type {}: PowerSGD sends its factors in fp32; valid: "
                          "communication_data_type fp32 or null, or gradient_compression: null",
                          to_string(*cfg.communication_data_type)));
  }
  namespace fs = std::filesystem;
  std::error_code ec;
  if (cfg.data.paths.empty()) {
    cfg.data.format = resolve_data_format(cfg, "data.path", cfg.data.path, cfg.data.format);
  } else {  // a blend: weight, path, weight, path, ... — each file checked; auto stays per file
    const std::vector<std::pair<double, std::string>> blend = data_blend(cfg);
    for (const auto& [w, path] : blend) resolve_data_format(cfg, "data.paths", path, cfg.data.format);
  }
  const std::string& resume = cfg.checkpoint.resume;
  if (resume != "auto" && resume != "none" && !fs::exists(resume, ec))
    fail_at(cfg, "checkpoint.resume",
            fmt::format("'{}' does not exist; valid: auto, none or the path of a checkpoint", resume));
}

}  // namespace

bool is_hdf5_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[8] = {};
  return in.read(head, 8) && std::memcmp(head, "\x89HDF\r\n\x1a\n", 8) == 0;
}

DataFormat data_format_of(const std::string& path, DataFormat format) {
  if (format != DataFormat::kAuto) return format;
  if (is_megatron_path(path)) return DataFormat::kMegatron;
  return is_hdf5_file(path) ? DataFormat::kTokens : DataFormat::kText;
}

std::vector<std::pair<double, std::string>> data_blend(const TrainConfig& cfg) {
  const std::vector<std::string>& p = cfg.data.paths;
  std::vector<std::pair<double, std::string>> out;
  if (p.empty()) return {{1.0, cfg.data.path}};
  if (p.size() % 2 != 0)
    fail_at(cfg, "data.paths",
            fmt::format("{} entries; valid: pairs of a weight and a path, as Megatron's --data-path 0.7 a 0.3 b",
                        p.size()));
  double total = 0;
  for (size_t i = 0; i < p.size(); i += 2) {
    char* end = nullptr;
    const double w = std::strtod(p[i].c_str(), &end);
    if (p[i].empty() || *end != '\0' || !(w > 0) || !std::isfinite(w))
      fail_at(cfg, "data.paths",
              fmt::format("entry {} is '{}' where a weight belongs; valid: pairs of a positive weight and a path", i + 1,
                          printable(p[i], 60)));
    out.emplace_back(w, p[i + 1]);
    total += w;
  }
  for (auto& [w, path] : out) w /= total;
  return out;
}

std::string megatron_prefix(const std::string& path) {
  const auto ends = [&](const char* tail) { return path.size() >= 4 && path.compare(path.size() - 4, 4, tail) == 0; };
  return ends(".idx") || ends(".bin") ? path.substr(0, path.size() - 4) : path;
}

bool is_megatron_path(const std::string& path) {
  std::error_code ec;
  if (megatron_prefix(path) != path) return true;
  return !std::filesystem::is_regular_file(path, ec) && std::filesystem::is_regular_file(path + ".idx", ec);
}

void validate(TrainConfig& cfg) {
  validate_model(cfg);
  validate_parallel(cfg);
  validate_training(cfg);
}

}  // namespace dstrain::config
