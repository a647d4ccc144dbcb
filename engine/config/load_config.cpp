#include "engine/config/load_config.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/config/yaml_io.h"

namespace dstrain::config {
namespace {

struct Override {
  std::vector<std::string> keys;
  std::string value;
  std::string text;
};

Override parse_override(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(fmt::format("--set {}: expected key.path=value, e.g. --set parallel.tensor=2",
                                  text));
  Override o{{}, text.substr(eq + 1), text};
  std::stringstream keys(text.substr(0, eq));
  for (std::string part; std::getline(keys, part, '.');) {
    if (part.empty())
      throw ConfigError(fmt::format("--set {}: empty key in path '{}'", text, text.substr(0, eq)));
    o.keys.push_back(part);
  }
  return o;
}

// Applies one override; returns the paths of the sections it had to create on the way.
std::vector<std::string> apply_override(YAML::Node& root, const Override& o) {
  std::vector<std::string> created;
  YAML::Node cur;
  cur.reset(root);
  std::string path;
  for (size_t i = 0; i + 1 < o.keys.size(); ++i) {
    path += (i ? "." : "") + o.keys[i];
    YAML::Node next = cur[o.keys[i]];
    if (!next.IsDefined() || next.IsNull()) {
      cur[o.keys[i]] = YAML::Node(YAML::NodeType::Map);
      next.reset(cur[o.keys[i]]);
      created.push_back(path);
    } else if (!next.IsMap()) {
      throw ConfigError(fmt::format("--set {}: {} is a value, not a section, so it has no key '{}'",
                                    o.text, path, o.keys[i + 1]));
    }
    cur.reset(next);
  }
  YAML::Node value;
  try {
    value = YAML::Load(o.value);
  } catch (const YAML::Exception& e) {
    throw ConfigError(fmt::format("--set {}: the value is not valid YAML: {}", o.text, e.msg));
  }
  cur[o.keys.back()] = value;
  return created;
}

// Records the position of every key in the tree; overridden keys (and everything under them)
// get the --set text instead.
void record_positions(const YAML::Node& node, const std::string& path, Source& src,
                      const std::map<std::string, std::string>& overrides, const std::string* inherited) {
  if (!node.IsMap()) return;
  for (auto it = node.begin(); it != node.end(); ++it) {
    if (!it->first.IsScalar()) continue;
    const std::string p = path.empty() ? it->first.Scalar() : path + "." + it->first.Scalar();
    const std::string* over = inherited;
    if (auto o = overrides.find(p); o != overrides.end()) over = &o->second;
    if (over) src.set_override(p, *over);
    else src.set_position(p, it->first.Mark().line, it->first.Mark().column);
    record_positions(it->second, p, src, overrides, over);
  }
}

// The nodes a reader of `n` visits, aliases expanded (an alias is a shared node: nine nested
// levels of ten make a billion visits), counted up to `limit` and no further.
size_t expanded_nodes(const YAML::Node& n, size_t limit, size_t count = 0) {
  if (++count > limit || !(n.IsMap() || n.IsSequence())) return count;
  for (auto it = n.begin(); it != n.end() && count <= limit; ++it) {
    if (n.IsMap()) {
      count = expanded_nodes(it->first, limit, count);
      if (count <= limit) count = expanded_nodes(it->second, limit, count);
    } else {
      count = expanded_nodes(*it, limit, count);
    }
  }
  return count;
}
constexpr size_t kMaxConfigNodes = 100000;  // a full config is a few hundred

void check_size(const YAML::Node& root, const std::string& name) {
  if (expanded_nodes(root, kMaxConfigNodes) > kMaxConfigNodes)
    throw ConfigError(fmt::format("{}: the config expands to more than {} YAML nodes (aliases nested in aliases?); "
                                  "valid: a config of sections and values, see configs/tiny.yaml",
                                  name, with_commas(int64_t(kMaxConfigNodes))));
}

// The environment variables that may override a `kernels:` key (docs/design.md §6.1, "Kernel
// options"): read here, when a config is loaded at start-up — nowhere in the kernels — applied
// before the --set overrides (which win), checked as the key's own values, and logged.
struct KernelEnv {
  const char* var;
  const char* key;
};
constexpr KernelEnv kKernelEnv[] = {
    {"DSTRAIN_LOWP_GEMM", "kernels.lowp_gemm"},           {"DSTRAIN_DENSE_GEMM", "kernels.cpu_dense_gemm"},
    {"DSTRAIN_GROUPED_GEMM", "kernels.cpu_grouped_gemm"}, {"DSTRAIN_ATTENTION_TILES", "kernels.cpu_attention"},
    {"DSTRAIN_CUDA_ATTENTION", "kernels.cuda_attention"}, {"DSTRAIN_CUDA_GROUPED_GEMM", "kernels.cuda_grouped_gemm"},
    {"DSTRAIN_CUDA_POISON", "kernels.cuda_poison"},       {"DSTRAIN_LOSS_CHUNK_TOKENS", "kernels.loss_chunk_tokens"},
};

std::vector<Override> kernel_env_overrides() {
  std::vector<Override> out;
  for (const KernelEnv& e : kKernelEnv) {
    const char* v = std::getenv(e.var);
    if (!v || !*v) continue;
    std::string value = v;
    if (std::string(e.var) == "DSTRAIN_CUDA_POISON") value = value == "1" ? "true" : value == "0" ? "false" : value;
    Override o = parse_override(std::string(e.key) + "=" + value);
    o.text = std::string(e.var) + "=" + v;  // (what a message about it quotes)
    out.push_back(o);
  }
  return out;
}

TrainConfig load_from_node(YAML::Node root, const std::string& name,
                           const std::vector<std::string>& overrides) {
  check_size(root, name);
  if (!root.IsDefined() || root.IsNull())  // with or without --set: an empty file is a mistake
    throw ConfigError(fmt::format("{}: the config is empty; valid: a YAML mapping of sections, "
                                  "see configs/tiny.yaml",
                                  name));
  if (!root.IsMap())
    throw ConfigError(fmt::format("{}:{}:{}: the config must be a YAML mapping of keys, got {}",
                                  name, root.Mark().line + 1, root.Mark().column + 1,
                                  node_text(root)));
  std::map<std::string, std::string> override_text;
  std::vector<Override> all = kernel_env_overrides();
  for (const Override& o : all) spdlog::info("{} sets {} (the environment overrides the config)", o.text, join(o.keys, "."));
  for (const auto& text : overrides) all.push_back(parse_override(text));
  for (const Override& o : all) {
    for (const std::string& created : apply_override(root, o)) override_text.emplace(created, o.text);
    override_text[join(o.keys, ".")] = o.text;
  }
  if (!all.empty()) check_size(root, name + " with its --set overrides");
  TrainConfig cfg;
  cfg.source = Source(name);
  record_positions(root, "", cfg.source, override_text, nullptr);
  Reader reader(root, "", cfg.source);
  describe(reader, cfg);
  reader.finish();
  validate(cfg);
  return cfg;
}

YAML::Node parse_yaml(const std::string& text, const std::string& name) {
  try {
    return YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw ConfigError(fmt::format("{}:{}:{}: malformed YAML: {}", name, e.mark.line + 1,
                                  e.mark.column + 1, e.msg));
  }
}

}  // namespace

TrainConfig load_config_text(const std::string& text, const std::string& name,
                             const std::vector<std::string>& overrides) {
  // yaml-cpp stops at a NUL byte and reports garbage: a binary file is refused here, by position.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    const size_t line = size_t(std::count(text.begin(), text.begin() + std::ptrdiff_t(nul), '\n')) + 1;
    const size_t line_start = text.rfind('\n', nul) == std::string::npos ? 0 : text.rfind('\n', nul) + 1;
    throw ConfigError(fmt::format("{}:{}:{}: the file holds a NUL byte (binary data, not YAML text); valid: a "
                                  "YAML text file such as configs/tiny.yaml",
                                  name, line, nul - line_start + 1));
  }
  return load_from_node(parse_yaml(text, name), name, overrides);
}

TrainConfig load_config_file(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw ConfigError(fmt::format("{}: is a directory, not a config file; valid: a YAML file such as "
                                  "configs/tiny.yaml",
                                  path));
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the config file (does it exist?)", path));
  std::stringstream buf;
  buf << in.rdbuf();
  return load_config_text(buf.str(), path, overrides);
}

std::string to_yaml(const TrainConfig& cfg) {
  TrainConfig copy = cfg;
  YAML::Emitter out;
  out << YAML::BeginMap;
  Writer w(out);
  describe(w, copy);
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

void fail_at(const TrainConfig& cfg, const std::string& path, const std::string& message) {
  throw ConfigError(fmt::format("{}: {}: {}", cfg.source.at(path), path, message));
}

}  // namespace dstrain::config
