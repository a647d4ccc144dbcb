// libFuzzer target: the config loader. Input: YAML text, then optionally a line "---set" and one
// --set override per line. Every input must end in a TrainConfig or a dstrain::ConfigError with a
// message — never a crash, another exception or undefined behaviour (the fuzz build runs under
// ASan and UBSan). Run from the repository root (configs/ and data/ are read).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/plan/parallel_plan.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> sets;
  if (const size_t marker = text.find("\n---set\n"); marker != std::string::npos) {
    std::string rest = text.substr(marker + 8);
    text.resize(marker);
    for (size_t start = 0; start <= rest.size();) {
      const size_t end = rest.find('\n', start);
      const std::string line = rest.substr(start, end == std::string::npos ? std::string::npos : end - start);
      if (!line.empty()) sets.push_back(line);
      if (end == std::string::npos) break;
      start = end + 1;
    }
  }
  try {
    const dstrain::config::TrainConfig cfg = dstrain::config::load_config_text(text, "fuzz.yaml", sets);
    dstrain::config::to_yaml(cfg);  // the writer too
    for (int world : {1, 2, 8}) {
      try {
        dstrain::plan::make_plan(cfg, world);
      } catch (const dstrain::ConfigError&) {
      }
    }
  } catch (const dstrain::ConfigError& e) {
    if (std::string(e.what()).empty()) __builtin_trap();  // every error says something
  }
  return 0;
}
