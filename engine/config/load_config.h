// Loading a config: YAML file (or text) + `--set key.path=value` overrides -> a validated
// TrainConfig. Everything that does not depend on the world size is checked here; the layout
// checks that need it (batch triangle, world size = TP x PP x DP) are in plan::make_plan.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "engine/config/train_config.h"

namespace dstrain::config {

// Reads and validates `path`. Throws ConfigError naming file:line:col, the key path, the value
// and what is valid.
TrainConfig load_config_file(const std::string& path, const std::vector<std::string>& overrides = {});

// Same for YAML text; `name` stands for the file name in messages.
TrainConfig load_config_text(const std::string& text, const std::string& name,
                             const std::vector<std::string>& overrides = {});

// The resolved config as YAML (every key, defaults included), as --print-config prints it.
std::string to_yaml(const TrainConfig& cfg);

// The model's Hugging Face config.json (docs/model.md §2 fields) as a JSON object.
std::string to_hf_config_json(const ModelConfig& m);
// The model of a Hugging Face config.json (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM): the
// keys dstrain's model has (to_hf_config_json's), checked as the YAML config's model section is;
// keys it has not (torch_dtype, use_cache, auto_map, ...) are skipped and, with `ignored`, listed
// there. A deepseek_v2 config without its routing keys gets V2's (softmax scores, greedy top-k,
// no renormalisation, scale 1, one group), not dstrain's V3 defaults. Throws ConfigError naming
// `file` for another model_type or a value the model section refuses.
ModelConfig model_from_hf_config(const std::string& json_text, const std::string& file,
                                 std::vector<std::string>* ignored = nullptr);
// The keys that change what the model computes and whose values in `saved_json` (a checkpoint's
// hf_config) differ from m's, each as "model.rope_theta 10000.0 in the checkpoint, 50000.0
// here"; none when they agree. Keys that only matter for training from scratch or for the loss
// (initializer_range, aux_loss_alpha, bias_update_speed, mtp_loss_weight, attention_dropout,
// the token ids, architectures) are not compared. An unreadable saved_json gives one entry.
std::vector<std::string> model_changes(const std::string& saved_json, const ModelConfig& m);

// World-size-independent checks and defaults that depend on other keys (validate.cpp).
void validate(TrainConfig& cfg);

// data.path as a Megatron-LM indexed dataset's prefix: PREFIX, PREFIX.idx or PREFIX.bin -> PREFIX;
// and whether a path names one (PREFIX.idx / PREFIX.bin, or a PREFIX beside an existing .idx).
std::string megatron_prefix(const std::string& path);
bool is_megatron_path(const std::string& path);
bool is_hdf5_file(const std::string& path);
// A data file's format: `format`, or under auto the file's own (as the config check resolves it).
DataFormat data_format_of(const std::string& path, DataFormat format);
// The datasets to train on with their normalised weights: data.paths' pairs (checked: an even
// count of entries, positive weights), or data.path alone with weight 1.
std::vector<std::pair<double, std::string>> data_blend(const TrainConfig& cfg);

// "cfg.yaml:3:11: parallel.tensor: <message>" for errors raised after reading.
[[noreturn]] void fail_at(const TrainConfig& cfg, const std::string& path, const std::string& message);

}  // namespace dstrain::config
