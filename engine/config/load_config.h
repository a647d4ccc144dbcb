// Loading a config: YAML file (or text) + `--set key.path=value` overrides -> a validated
// TrainConfig. Everything that does not depend on the world size is checked here; the layout
// checks that need it (batch triangle, world size = TP x PP x DP) are in plan::make_plan.
#pragma once

#include <string>
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
// The keys that change what the model computes and whose values in `saved_json` (a checkpoint's
// hf_config) differ from m's, each as "model.rope_theta 10000.0 in the checkpoint, 50000.0
// here"; none when they agree. Keys that only matter for training from scratch or for the loss
// (initializer_range, aux_loss_alpha, bias_update_speed, mtp_loss_weight, attention_dropout,
// the token ids, architectures) are not compared. An unreadable saved_json gives one entry.
std::vector<std::string> model_changes(const std::string& saved_json, const ModelConfig& m);

// World-size-independent checks and defaults that depend on other keys (validate.cpp).
void validate(TrainConfig& cfg);

// "cfg.yaml:3:11: parallel.tensor: <message>" for errors raised after reading.
[[noreturn]] void fail_at(const TrainConfig& cfg, const std::string& path, const std::string& message);

}  // namespace dstrain::config
