// Built-in model presets (docs/model.md §9). `model: {preset: small}` starts from one of these;
// configs/<name>.yaml spells the same values out for users to copy (a test keeps them equal).
#pragma once

#include <string>
#include <vector>

#include "engine/config/train_config.h"

namespace dstrain::config {

// "tiny", "small", "medium", "deepseek-v2-lite", "deepseek-v3".
const std::vector<std::string>& preset_names();

// The model of a preset; throws ConfigError for an unknown name.
ModelConfig model_preset(const std::string& name);

}  // namespace dstrain::config
