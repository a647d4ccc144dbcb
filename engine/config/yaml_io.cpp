#include "engine/config/yaml_io.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <map>

#include <fmt/format.h>

#include "engine/common/strings.h"

namespace dstrain::config {
namespace {

bool is_plain_scalar(const YAML::Node& n) { return n.IsScalar(); }

}  // namespace

namespace {
void set_flow_style(YAML::Node n) {
  if (n.IsMap() || n.IsSequence()) {
    n.SetStyle(YAML::EmitterStyle::Flow);
    for (auto it = n.begin(); it != n.end(); ++it) set_flow_style(n.IsMap() ? it->second : *it);
  }
}
}  // namespace

std::string node_text(const YAML::Node& n) {
  if (!n || n.IsNull()) return "null";
  if (n.IsScalar()) return n.Scalar().empty() ? "\"\"" : n.Scalar();
  YAML::Node copy = YAML::Clone(n);
  set_flow_style(copy);
  YAML::Emitter out;
  out << copy;
  // Error messages quote values: a long one (a whole section, a pasted blob) is cut short.
  constexpr size_t kMax = 200;
  const std::string text = out.c_str();
  return text.size() <= kMax ? text : text.substr(0, kMax) + fmt::format("... ({} characters)", text.size());
}

bool parse_value(const YAML::Node& n, bool& out, std::string& why) {
  why = "expected true or false";
  if (!is_plain_scalar(n)) return false;
  const std::string& s = n.Scalar();
  if (s == "true" || s == "True" || s == "TRUE") return out = true, true;
  if (s == "false" || s == "False" || s == "FALSE") return out = false, true;
  return false;
}

bool parse_value(const YAML::Node& n, int64_t& out, std::string& why) {
  why = "expected an integer";
  if (!is_plain_scalar(n)) return false;
  const std::string& s = n.Scalar();
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, out);
  if (ec == std::errc() && ptr == end) return true;
  // DeepSpeed configs often write sizes as 5e8: accept a float literal with an integral value.
  char* fend = nullptr;
  const double d = std::strtod(s.c_str(), &fend);
  if (fend == s.c_str() + s.size() && !s.empty() && std::isfinite(d) && d == std::floor(d) &&
      std::fabs(d) < 9.0e18) {
    out = static_cast<int64_t>(d);
    return true;
  }
  return false;
}

bool parse_value(const YAML::Node& n, double& out, std::string& why) {
  why = "expected a number";
  if (!is_plain_scalar(n)) return false;
  const std::string& s = n.Scalar();
  if (s.empty()) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(out);
}

bool parse_value(const YAML::Node& n, std::string& out, std::string& why) {
  why = "expected a string";
  if (n.IsNull()) {  // `key:` or --set key= : the empty string (which "" disables where it may)
    out.clear();
    return true;
  }
  if (!is_plain_scalar(n)) return false;
  out = n.Scalar();
  return true;
}

bool parse_value(const YAML::Node& n, AutoInt& out, std::string& why) {
  if (is_plain_scalar(n) && n.Scalar() == "auto") {
    out.value = 0;
    return true;
  }
  int64_t v = 0;
  if (!parse_value(n, v, why) || v < 1) {
    why = "expected auto or an integer >= 1";
    return false;
  }
  out.value = v;
  return true;
}

const std::vector<std::string>& all_key_paths() {
  static const std::vector<std::string> keys = [] {
    TrainConfig cfg;
    KeyCollector k;
    describe(k, cfg);
    std::vector<std::string> out = k.keys();
    // Scheduler params differ by type; list the union so every valid key can be suggested.
    for (const SchedulerType type : {SchedulerType::kWarmupDecayLR, SchedulerType::kWarmupCosineLR}) {
      SchedulerParams p;
      KeyCollector s("scheduler.params.");
      describe_scheduler_params(s, p, type);
      for (const auto& key : s.keys())
        if (std::find(out.begin(), out.end(), key) == out.end()) out.push_back(key);
    }
    return out;
  }();
  return keys;
}

Reader::Reader(const YAML::Node& node, std::string path, const Source& src)
    : node_(node), path_(std::move(path)), src_(src) {
  std::map<std::string, int> seen;
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    if (!it->first.IsScalar())
      throw ConfigError(fmt::format("{}: {}: a key must be a plain name, got {}",
                                    src_.at(path_), path_.empty() ? "(top level)" : path_,
                                    node_text(it->first)));
    const std::string key = it->first.Scalar();
    const int line = it->first.Mark().line + 1;
    if (auto prev = seen.find(key); prev != seen.end())
      throw ConfigError(fmt::format("{}: {}: duplicate key (first given at line {}); valid: each "
                                    "key once per section",
                                    src_.at(child(key)), child(key), prev->second));
    seen[key] = line;
  }
}

YAML::Node Reader::lookup(std::string_view key) const {
  for (auto it = node_.begin(); it != node_.end(); ++it)
    if (it->first.Scalar() == key) return it->second;
  return YAML::Node(YAML::NodeType::Undefined);
}

std::string Reader::child(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

void Reader::fail(const std::string& path, const YAML::Node& n, const std::string& why) const {
  throw ConfigError(fmt::format("{}: {}: invalid value {}: {}", src_.at(path), path, node_text(n),
                                why));
}

void Reader::preset(std::string_view key, ModelConfig& model) {
  known_.emplace_back(key);
  const YAML::Node n = lookup(key);
  if (!n) return;
  std::string name, why;
  if (!parse_value(n, name, why)) fail(child(key), n, why);
  const auto& names = preset_names();
  if (std::find(names.begin(), names.end(), name) == names.end())
    fail(child(key), n, "valid: one of " + join(names, ", "));
  model = model_preset(name);
}

void Reader::finish() {
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    const std::string key = it->first.Scalar();
    if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
    std::string hint;
    if (std::string local = closest_match(key, known_); !local.empty()) {
      hint = fmt::format("did you mean '{}'? ", child(local));
    } else {
      // A key in the wrong section: compare with the last component of every valid path.
      for (const auto& p : all_key_paths()) {
        const std::string last = p.substr(p.rfind('.') + 1);
        if (p == child(key)) {  // e.g. a scheduler param of another scheduler type
          hint = "it belongs to another type of this section; ";
          break;
        }
        if (last == key || edit_distance(key, last) <= 1) {
          hint = fmt::format("did you mean '{}'? ", p);
          break;
        }
      }
    }
    throw ConfigError(fmt::format("{}: {}: unknown key; {}valid keys here: {}", src_.at(child(key)),
                                  child(key), hint, join(known_, ", ")));
  }
}

void Writer::preset(std::string_view key, ModelConfig& model) {
  if (model.preset.empty()) return;
  out_ << YAML::Key << std::string(key) << YAML::Value << model.preset;
}

void Writer::emit(bool v) { out_ << (v ? "true" : "false"); }
void Writer::emit(int64_t v) { out_ << v; }
void Writer::emit(double v) {
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, v);  // shortest text that round-trips
  std::string s(buf, ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  out_ << s;
}
void Writer::emit(const std::string& v) {
  if (v.empty()) out_ << YAML::DoubleQuoted << "";
  else out_ << v;
}
void Writer::emit(const AutoInt& v) {
  if (v.is_auto()) out_ << "auto";
  else out_ << v.value;
}

}  // namespace dstrain::config
