// Shared helpers for the unit tests.
#pragma once

#include <string>
#include <vector>

#include "engine/common/error.h"
#include "engine/config/load_config.h"

namespace dstrain::testing {

// A small valid config: the tiny preset, batch 8, the shipped corpus (tests run in the source dir).
inline std::string base_yaml() {
  return "train_batch_size: 8\n"
         "model:\n"
         "  preset: tiny\n"
         "data:\n"
         "  path: data/tinyshakespeare.txt\n";
}

inline config::TrainConfig load(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  return config::load_config_text(yaml, "test.yaml", sets);
}

}  // namespace dstrain::testing
