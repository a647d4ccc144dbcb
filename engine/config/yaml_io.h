// Visitors that run the schema (schema.h) over YAML: a strict Reader, a Writer for
// --print-config, and a KeyCollector that lists every valid key path.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "engine/common/error.h"
#include "engine/config/schema.h"

namespace dstrain::config {

// The element type a Check applies to: X for std::optional<X> and std::vector<X>, else T.
template <class T> struct inner { using type = T; };
template <class T> struct inner<std::optional<T>> { using type = T; };
template <class T> struct inner<std::vector<T>> { using type = T; };
template <class T> using inner_t = typename inner<T>::type;

// Scalar conversions. Each returns false and sets `why` ("expected an integer") on a type error.
bool parse_value(const YAML::Node& n, bool& out, std::string& why);
bool parse_value(const YAML::Node& n, int64_t& out, std::string& why);
bool parse_value(const YAML::Node& n, double& out, std::string& why);
bool parse_value(const YAML::Node& n, std::string& out, std::string& why);
bool parse_value(const YAML::Node& n, AutoInt& out, std::string& why);
template <ConfigEnum E>
bool parse_value(const YAML::Node& n, E& out, std::string& why) {
  std::string text;
  if (!parse_value(n, text, why)) return false;
  const std::optional<E> e = parse_enum<E>(text);
  if (!e) {
    why = "valid: one of " + enum_choices<E>();
    return false;
  }
  out = *e;
  return true;
}
template <class T>
bool parse_value(const YAML::Node& n, std::optional<T>& out, std::string& why) {
  if (n.IsNull()) {
    out.reset();
    return true;
  }
  T v{};
  if (!parse_value(n, v, why)) return false;
  out = v;
  return true;
}
template <class T>
bool parse_value(const YAML::Node& n, std::vector<T>& out, std::string& why) {
  if (!n.IsSequence()) {
    why = "expected a list";
    return false;
  }
  out.clear();
  for (const auto& item : n) {
    T v{};
    if (!parse_value(item, v, why)) {
      why = "in the list: " + why;
      return false;
    }
    out.push_back(v);
  }
  return true;
}

// One-line text of a YAML value, for error messages.
std::string node_text(const YAML::Node& n);

// Every valid key path ("fp16.loss_scale_window", ...), for suggestions and docs.
const std::vector<std::string>& all_key_paths();

class Reader {
 public:
  // Reads the mapping `node` found at `path` ("" for the root). Checks for duplicate keys.
  Reader(const YAML::Node& node, std::string path, const Source& src);

  template <class T, class C = inner_t<T>>
  void field(std::string_view key, T& out, const Check<C>& check = {}) {
    known_.emplace_back(key);
    const YAML::Node n = lookup(key);
    if (!n) return;
    const std::string p = child(key);
    std::string why;
    if (!parse_value(n, out, why)) fail(p, n, why);
    if (check.ok) apply_check(p, n, out, check);
  }

  template <class S>
  void section(std::string_view key, S& sub) {
    section_with(key, [&](Reader& r) { describe(r, sub); });
  }

  template <class S>
  void nullable_section(std::string_view key, std::optional<S>& sub) {
    known_.emplace_back(key);
    const YAML::Node n = lookup(key);
    if (!n) return;
    if (n.IsNull()) {
      sub.reset();
      return;
    }
    if (!sub) sub.emplace();
    read_mapping(key, n, [&](Reader& r) { describe(r, *sub); });
  }

  template <class F>
  void section_with(std::string_view key, F&& fn) {
    known_.emplace_back(key);
    const YAML::Node n = lookup(key);
    if (!n || n.IsNull()) return;  // `fp16:` with nothing under it keeps the defaults
    read_mapping(key, n, fn);
  }

  void preset(std::string_view key, ModelConfig& model);

  // Fails on the first key of this mapping that the schema did not ask for.
  void finish();

 private:
  YAML::Node lookup(std::string_view key) const;
  std::string child(std::string_view key) const;
  [[noreturn]] void fail(const std::string& path, const YAML::Node& n, const std::string& why) const;

  template <class F>
  void read_mapping(std::string_view key, const YAML::Node& n, F&& fn) {
    if (!n.IsMap()) fail(child(key), n, "expected a mapping of keys");
    Reader sub(n, child(key), src_);
    fn(sub);
    sub.finish();
  }

  template <class T, class C>
  void apply_check(const std::string& p, const YAML::Node& n, const T& v, const Check<C>& check) {
    if constexpr (std::is_same_v<T, std::optional<C>>) {
      if (v && !check.ok(*v)) fail(p, n, "valid: " + check.valid);
    } else if constexpr (std::is_same_v<T, std::vector<C>>) {
      for (const auto& e : v)
        if (!check.ok(e)) fail(p, n, "each element must be " + check.valid);
    } else {
      if (!check.ok(v)) fail(p, n, "valid: " + check.valid);
    }
  }

  YAML::Node node_;
  std::string path_;
  const Source& src_;
  std::vector<std::string> known_;
};

class Writer {
 public:
  explicit Writer(YAML::Emitter& out) : out_(out) {}

  template <class T, class C = inner_t<T>>
  void field(std::string_view key, T& v, const Check<C>& = {}) {
    out_ << YAML::Key << std::string(key) << YAML::Value;
    emit(v);
  }
  template <class S>
  void section(std::string_view key, S& sub) {
    section_with(key, [&](Writer& w) { describe(w, sub); });
  }
  template <class S>
  void nullable_section(std::string_view key, std::optional<S>& sub) {
    if (!sub) {
      out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Null;
      return;
    }
    section(key, *sub);
  }
  template <class F>
  void section_with(std::string_view key, F&& fn) {
    out_ << YAML::Key << std::string(key) << YAML::Value << YAML::BeginMap;
    fn(*this);
    out_ << YAML::EndMap;
  }
  void preset(std::string_view key, ModelConfig& model);

 private:
  void emit(bool v);
  void emit(int64_t v);
  void emit(double v);
  void emit(const std::string& v);
  void emit(const AutoInt& v);
  template <ConfigEnum E>
  void emit(E v) {
    emit(to_string(v));
  }
  template <class T>
  void emit(const std::optional<T>& v) {
    if (v) emit(*v);
    else out_ << YAML::Null;
  }
  template <class T>
  void emit(const std::vector<T>& v) {
    out_ << YAML::Flow << YAML::BeginSeq;
    for (const auto& e : v) emit(e);
    out_ << YAML::EndSeq;
  }

  YAML::Emitter& out_;
};

class KeyCollector {
 public:
  explicit KeyCollector(std::string prefix = "") : prefix_(std::move(prefix)) {}

  template <class T, class C = inner_t<T>>
  void field(std::string_view key, T&, const Check<C>& = {}) {
    keys_.push_back(prefix_ + std::string(key));
  }
  template <class S>
  void section(std::string_view key, S& sub) {
    section_with(key, [&](KeyCollector& k) { describe(k, sub); });
  }
  template <class S>
  void nullable_section(std::string_view key, std::optional<S>&) {
    S tmp{};
    section(key, tmp);
  }
  template <class F>
  void section_with(std::string_view key, F&& fn) {
    KeyCollector sub(prefix_ + std::string(key) + ".");
    fn(sub);
    keys_.insert(keys_.end(), sub.keys_.begin(), sub.keys_.end());
  }
  void preset(std::string_view key, ModelConfig&) { keys_.push_back(prefix_ + std::string(key)); }

  const std::vector<std::string>& keys() const { return keys_; }

 private:
  std::string prefix_;
  std::vector<std::string> keys_;
};

}  // namespace dstrain::config

namespace dstrain::config {

// One row of the config reference: generated from the schema, so the docs cannot drift.
struct KeyDoc {
  std::string path;
  std::string meaning;
  std::string type;
  std::string default_value;
  std::string valid;
};

// One line on what a key does ("" for an unknown path).
const std::string& key_meaning(const std::string& path);

// Every key with its type, default and valid values, in schema order. Scheduler params are
// listed for every scheduler type, with the types they apply to in `valid`.
std::vector<KeyDoc> config_reference();

// The reference as a Markdown table (what `dstrain --config-reference` prints).
std::string config_reference_markdown();

}  // namespace dstrain::config
