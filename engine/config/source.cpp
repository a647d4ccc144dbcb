#include "engine/config/source.h"

#include <fmt/format.h>

namespace dstrain::config {

void Source::set_position(const std::string& path, int line, int column) {
  where_[path] = fmt::format("{}:{}:{}", file_, line + 1, column + 1);
}

void Source::set_override(const std::string& path, const std::string& text) {
  // (an environment variable's override names itself: DSTRAIN_LOWP_GEMM=native, config/load_config.cpp)
  where_[path] = text.rfind("DSTRAIN_", 0) == 0 ? "the environment's " + text : "--set " + text;
  overridden_[path] = true;
}

bool Source::overridden(const std::string& path) const { return overridden_.count(path) > 0; }

std::string Source::at(const std::string& path) const {
  if (auto it = where_.find(path); it != where_.end()) return it->second;
  // A model field that the file does not spell out comes from the preset, if one is named.
  if (path.rfind("model.", 0) == 0 && path != "model.preset") {
    if (auto it = where_.find("model.preset"); it != where_.end())
      return it->second + " (value from model.preset)";
  }
  return file_.empty() ? std::string("(default)") : file_ + " (default)";
}

}  // namespace dstrain::config
