// Where each config value came from: a file position, a --set override, a preset or a default.
// Every config error starts with this location, so a user can jump straight to the line.
#pragma once

#include <map>
#include <string>

namespace dstrain::config {

class Source {
 public:
  Source() = default;
  explicit Source(std::string file) : file_(std::move(file)) {}

  const std::string& file() const { return file_; }

  // Records that `path` (e.g. "parallel.tensor") sits at line/column (0-based, as yaml-cpp).
  void set_position(const std::string& path, int line, int column);
  // Records that `path` was set on the command line by `--set text`.
  void set_override(const std::string& path, const std::string& text);

  bool has(const std::string& path) const { return where_.count(path) > 0; }
  bool overridden(const std::string& path) const;

  // "cfg.yaml:3:11", "--set parallel.tensor=3", "cfg.yaml:2:11 (model.preset small)" or
  // "cfg.yaml (default)": the best location for an error about `path`.
  std::string at(const std::string& path) const;

 private:
  std::string file_;
  std::map<std::string, std::string> where_;
  std::map<std::string, bool> overridden_;
};

}  // namespace dstrain::config
