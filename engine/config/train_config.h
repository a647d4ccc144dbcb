// The typed configuration of a dstrain run (docs/design.md §3).
//
// Key names follow DeepSpeed where DeepSpeed has the concept (train_batch_size, fp16, bf16,
// zero_optimization, optimizer, scheduler, ...), Hugging Face DeepSeek config.json inside
// `model:`, and dstrain's own sections (parallel, data, checkpoint, monitor) elsewhere.
// The schema itself (which keys exist, their types, defaults and valid values) is written once,
// in schema.h; this file holds only the structs and their defaults.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/config/enums.h"
#include "engine/config/source.h"

namespace dstrain::config {

enum class Precision { kFp32, kBf16, kFp16 };
const char* to_string(Precision p);

// `parallel.data: auto` or a number; 0 means auto (world_size / (tensor * pipeline)).
struct AutoInt {
  int64_t value = 0;
  bool is_auto() const { return value == 0; }
};

struct RopeScaling {  // HF `rope_scaling` (YaRN only)
  std::string type = "yarn";
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// Hugging Face DeepSeek config.json fields (docs/model.md §2). Defaults are those of HF's
// DeepseekV3Config, i.e. DeepSeek-V3 with max_position_embeddings 4096; a `preset:` replaces
// them all before the other keys of the section are applied.
struct ModelConfig {
  std::string preset;  // "" when the section spells out the model itself
  ModelType model_type = ModelType::kDeepseekV3;
  std::vector<std::string> architectures;
  int64_t vocab_size = 129280;
  int64_t hidden_size = 7168;
  int64_t intermediate_size = 18432;
  int64_t moe_intermediate_size = 2048;
  int64_t num_hidden_layers = 61;
  int64_t num_attention_heads = 128;
  int64_t num_key_value_heads = 128;
  std::optional<int64_t> q_lora_rank = 1536;  // null: a single q_proj (V2-Lite)
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  std::optional<int64_t> n_routed_experts = 256;  // null: a dense model
  std::optional<int64_t> n_shared_experts = 1;
  int64_t num_experts_per_tok = 8;
  int64_t first_k_dense_replace = 3;
  int64_t moe_layer_freq = 1;
  ScoringFunc scoring_func = ScoringFunc::kSigmoid;
  TopkMethod topk_method = TopkMethod::kNoauxTc;
  int64_t n_group = 8;
  int64_t topk_group = 4;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 2.5;
  double aux_loss_alpha = 0.001;
  bool seq_aux = true;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<RopeScaling> rope_scaling;
  bool rope_interleave = true;
  int64_t max_position_embeddings = 4096;
  double initializer_range = 0.02;
  std::string hidden_act = "silu";
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double attention_dropout = 0.0;
  std::optional<int64_t> bos_token_id = 0;
  std::optional<int64_t> eos_token_id = 1;
  std::optional<int64_t> pad_token_id;
  int64_t num_nextn_predict_layers = 0;  // MTP modules
  double bias_update_speed = 0.001;      // dstrain extension: γ of the aux-loss-free bias update
  double mtp_loss_weight = 0.3;          // dstrain extension: λ of the MTP loss

  // Derived helpers used everywhere the model's shape matters.
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t num_routed() const { return n_routed_experts.value_or(0); }
  int64_t num_shared() const { return n_shared_experts.value_or(0); }
  bool is_moe_layer(int64_t layer) const;  // docs/model.md §2 placement rule
};

struct ParallelConfig {
  int64_t tensor = 1;
  int64_t pipeline = 1;
  int64_t expert = 1;
  AutoInt data;                      // auto: world_size / (tensor * pipeline)
  std::vector<int64_t> stage_layers;  // decoder layers per pipeline stage; empty: uniform
  double comm_timeout_s = 600;        // watchdog deadline of every collective
  bool sequence_parallel = false;     // Megatron's: norms and residuals split by tokens over TP
  PipelineScheduleKind pipeline_schedule = PipelineScheduleKind::kOneFOneB;
  int64_t virtual_stages = 1;         // model chunks per pipeline rank (interleaved schedule)
};

struct Fp16Config {  // DeepSpeed `fp16` with its defaults
  bool enabled = false;
  double loss_scale = 0.0;  // 0: dynamic loss scaling
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
};

struct Bf16Config {
  bool enabled = false;
};

struct ZeroConfig {  // DeepSpeed `zero_optimization` (sizes in elements, as DeepSpeed's)
  int64_t stage = 0;
  bool overlap_comm = true;                  // reduce gradient buckets during backward
  int64_t reduce_bucket_size = 4'194'304;    // 16 MiB of fp32: the fastest all-reduce size on one host
  int64_t allgather_bucket_size = 4'194'304; // ZeRO-1/2 parameter all-gather pieces
};

// PowerSGD gradient compression (PyTorch's DDP comm hook powerSGD_hook and its PowerSGDState;
// docs/design.md §6.5, "PowerSGD"): each gradient matrix of the data-parallel reduction sent as
// two rank-`rank` factors P [rows, rank] and Q [cols, rank] instead of itself.
struct GradientCompressionConfig {
  std::string type = "powersgd";
  int64_t rank = 1;                   // PowerSGDState.matrix_approximation_rank
  int64_t start_iter = 1000;          // steps reduced uncompressed first (start_powerSGD_iter)
  double min_compression_rate = 2.0;  // compress a [n, m] matrix only when n m > rate (n + m) rank
  bool use_error_feedback = true;     // add what compression lost to the next step's gradient
  bool warm_start = true;             // start each step's power iteration from the last step's Q
};

struct OptimizerParams {  // DeepSpeed Adam / AdamW params
  double lr = 1e-3;
  std::vector<double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // DeepSpeed's Adam: decoupled (AdamW) weight decay by default
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  OptimizerParams params;
};

// DeepSpeed scheduler params; which of them exist depends on `type`.
struct SchedulerParams {
  double warmup_min_lr = 0.0;      // WarmupLR, WarmupDecayLR
  double warmup_max_lr = 0.001;    // WarmupLR, WarmupDecayLR
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  std::optional<int64_t> total_num_steps;  // WarmupDecayLR, WarmupCosineLR; default train_steps
  double warmup_min_ratio = 0.0;   // WarmupCosineLR
  double cos_min_ratio = 0.0001;   // WarmupCosineLR
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kWarmupLR;
  SchedulerParams params;
};

struct ActivationCheckpointingConfig {
  bool enabled = false;
  // full: keep each decoder layer's input only and run its forward again before its backward;
  // selective: recompute only the memory-heavy, cheap parts (docs/design.md §6.7)
  CheckpointGranularity granularity = CheckpointGranularity::kFull;
  std::optional<int64_t> num_layers;  // decoder layers per pipeline stage (model chunk), from its first; null: all
};

struct DataConfig {
  std::string path = "data/tinyshakespeare.txt";
  // A blend, Megatron's --data-path semantics: weight, path, weight, path, ... (weights
  // normalised); when given, it replaces `path`. Each dataset is read per data.format.
  std::vector<std::string> paths;
  // text: raw bytes (token id = byte value); tokens: a dstrain-prep dataset (HDF5); auto: which
  // of the two the file is, from its first bytes (resolved when the config is loaded)
  DataFormat format = DataFormat::kAuto;
  double validation_fraction = 0.05;
  int64_t eval_interval = 100;  // steps between validation runs; 0: none (Megatron's name)
  int64_t eval_iters = 8;       // global batches per validation run (Megatron's name)
};

struct CheckpointConfig {
  std::string dir = "checkpoints";
  int64_t interval = 0;     // steps between saves; 0: only at the end and on SIGTERM/SIGINT
  bool save_at_end = true;  // false: no save after the last step (benchmarks); interval and signal saves stay
  int64_t keep_last = 3;
  std::string resume = "auto";  // auto | none | a checkpoint path
  bool async = false;
  bool allow_data_change = false;  // resume on data tokenized differently from the checkpoint's
  bool allow_model_change = false;  // resume with model keys (rope_theta, ...) other than the checkpoint's
};

struct MonitorConfig {
  std::string metrics_file;  // JSON Lines; "" disables
  std::string tensorboard;   // event-file directory; "" disables
  std::string log_level = "info";
  int64_t expert_stats_interval = 100;  // steps between per-expert load lines; 0: none
  double peak_tflops = 0.0;             // MFU denominator; 0: measure the GEMM peak at start
  bool comm_log = false;                // per-collective counts, bytes, times, bandwidths (DeepSpeed's comms logger)
  std::string trace;                    // Chrome / Perfetto trace file of trace_steps; "" disables
  std::vector<int64_t> trace_steps = {2, 3};  // first and last step traced (1-based, inclusive)
  // Time per kernel op of each step (CUDA events on the GPU, the host clock on the CPU), averaged
  // over the steps after the first and printed at the end of the run (docs/design.md §6.12)
  bool op_breakdown = false;
};

// Which implementation a kernel takes where there are several (docs/design.md §6.1, "Kernel
// options"): kernels::KernelOptions's fields, plus the LM head's chunking. Each may also come
// from its DSTRAIN_ environment variable, read once when the config is loaded and logged.
struct KernelsConfig {
  std::string lowp_gemm = "auto";          // DSTRAIN_LOWP_GEMM: auto | native | widened
  std::string cpu_dense_gemm = "auto";     // DSTRAIN_DENSE_GEMM: auto | amx | onednn
  std::string cpu_grouped_gemm = "auto";   // DSTRAIN_GROUPED_GEMM
  std::string cpu_attention = "auto";      // DSTRAIN_ATTENTION_TILES
  std::string cuda_attention = "tiled";    // DSTRAIN_CUDA_ATTENTION: tiled | rows | cudnn
  std::string cuda_grouped_gemm = "grouped";  // DSTRAIN_CUDA_GROUPED_GEMM: grouped | loop
  bool cuda_poison = false;                // DSTRAIN_CUDA_POISON=1
  int64_t loss_chunk_tokens = 0;           // DSTRAIN_LOSS_CHUNK_TOKENS; 0: automatic
};

struct TrainConfig {
  std::optional<int64_t> train_batch_size;  // sequences per optimizer step, all ranks together
  // auto: the largest micro-batch whose state and activations fit memory_budget_gib (the plan's
  // figures), train_batch_size kept (docs/design.md §7.4.2)
  std::optional<AutoInt> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<double> memory_budget_gib;  // per rank; null: this host's available memory / its ranks
  int64_t seq_length = 256;
  int64_t train_steps = 1000;
  int64_t seed = 42;
  // Where the math runs: cpu, cuda (one GPU per rank, by local rank), or auto — cuda when this
  // build has the CUDA backend and a GPU is visible, else cpu
  DeviceKind device = DeviceKind::kAuto;
  double gradient_clipping = 0.0;  // 0: no clipping (DeepSpeed's default)
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  Fp16Config fp16;
  Bf16Config bf16;
  // DeepSpeed's: the type the data-parallel gradient reduction rounds to; null: fp32 (the
  // gradients accumulate in fp32 whatever the compute type)
  std::optional<CommDataType> communication_data_type;
  ZeroConfig zero_optimization;
  // null: gradients reduced whole (DeepSpeed's default); powersgd: compressed (ZeRO 0/1, no
  // pipeline, gradients in host memory)
  std::optional<GradientCompressionConfig> gradient_compression;
  OptimizerConfig optimizer;
  std::optional<SchedulerConfig> scheduler;  // absent: constant learning rate
  ActivationCheckpointingConfig activation_checkpointing;
  ModelConfig model;
  ParallelConfig parallel;
  DataConfig data;
  CheckpointConfig checkpoint;
  MonitorConfig monitor;
  KernelsConfig kernels;

  Source source;  // where each key came from, for error messages

  Precision precision() const;
};

}  // namespace dstrain::config
