#include "engine/data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <functional>
#include <queue>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine/common/error.h"

namespace dstrain::data {
namespace {

using Json = nlohmann::json;

// GPT-2's pre-tokenisation pattern, which ByteLevel applies with use_regex.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Byte-level BPE's alphabet: byte b as one Unicode character — itself for the printable
// Latin-1 bytes, 256 + n (n counting the others in order) for the rest — in UTF-8.
std::array<std::string, 256> byte_chars() {
  std::array<std::string, 256> out;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {  // (all below 0x800: two bytes)
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    out[size_t(b)] = s;
  }
  return out;
}

// A compiled regex (UTF-8, Unicode properties; invalid UTF-8 in the text matched around, not an
// error) and its match data.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE at = 0;
    // (^ and $ anchor at lines, as in Oniguruma's Ruby syntax, which `tokenizers` uses)
    uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | PCRE2_MULTILINE;
    if (literal) options = PCRE2_LITERAL | PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err, &at, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw ConfigError(fmt::format("{}: the pattern {} does not compile (at {}): {}", where, Json(pattern).dump(),
                                    size_t(at), reinterpret_cast<const char*>(msg)));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // (where the JIT is missing, matching still works)
    data_ = pcre2_match_data_create_from_pattern(code_, nullptr);
    if (!data_) {
      pcre2_code_free(code_);
      throw std::bad_alloc();
    }
    where_ = where;
  }
  ~Regex() {
    pcre2_match_data_free(data_);
    pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The matches in s, in order: [begin, end) offsets; an empty match is kept (a split point).
  // A matching error (a resource limit) is a ConfigError rather than text left unsplit.
  void matches(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
    out.clear();
    size_t at = 0;
    while (at <= s.size()) {
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), at, 0, data_, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        throw ConfigError(fmt::format("{}: a pre-tokenizer pattern failed on a {}-byte piece of text: {}", where_,
                                      s.size(), reinterpret_cast<const char*>(msg)));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data_);
      const size_t b = ov[0], e = ov[1];
      out.emplace_back(b, e);
      if (e > b) {
        at = e;
      } else {  // an empty match: move on by one character
        at = b + 1;
        while (at < s.size() && (static_cast<unsigned char>(s[at]) & 0xC0) == 0x80) ++at;
      }
    }
  }

 private:
  pcre2_code* code_ = nullptr;
  pcre2_match_data* data_ = nullptr;
  std::string where_;
};

enum class Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Step {
  std::unique_ptr<Regex> regex;  // Split, or ByteLevel with use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool prefix_space = false;  // ByteLevel's add_prefix_space
};

struct Added {
  std::string content;
  int32_t id = 0;
  bool lstrip = false, rstrip = false, single_word = false;
};

bool is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
bool is_word(unsigned char c) { return std::isalnum(c) || c == '_' || c >= 0x80; }

}  // namespace

struct HfTokenizer::Impl {
  std::string path;
  std::unordered_map<std::string, int32_t> vocab;  // byte-level token -> id
  std::vector<std::string> token_of;               // id -> byte-level token or added content
  std::vector<char> is_added;                      // id -> an added token (decoded as its content)
  std::array<int32_t, 256> byte_id{};
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left, right) -> (rank, merged id)
  bool ignore_merges = false;
  std::vector<Step> steps;
  bool byte_level_seen = false;
  std::vector<Added> added;  // longest first
  std::array<std::vector<const Added*>, 256> added_by_first;  // by their first byte, longest first
  std::vector<int32_t> prefix, suffix;  // the post-processor's tokens around a sequence
  std::optional<int32_t> bos, eos;
  int64_t size = 0;
  std::array<std::string, 256> chars = byte_chars();
  std::unordered_map<std::string, unsigned char> char_byte;  // the inverse of chars
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;
  mutable std::vector<std::pair<size_t, size_t>> found;

  // A token id of the file: an integer in [0, 2^24) (the largest vocabularies are 2^18).
  int32_t checked_id(const Json& v, const std::string& token) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (int64_t(1) << 24))
      refuse(fmt::format("token {} has the id {}, not an integer from 0 to 2^24", Json(token).dump(), v.dump()));
    return int32_t(v.get<int64_t>());
  }

  [[noreturn]] void refuse(const std::string& what) const {
    throw ConfigError(fmt::format("{}: {}; dstrain reads byte-level BPE tokenizers (GPT-2's, DeepSeek's)", path, what));
  }

  void parse_pre_tokenizer(const Json& p) {
    if (p.is_null()) return;
    const std::string type = p.value("type", "");
    if (type == "Sequence") {
      for (const Json& q : p.at("pretokenizers")) parse_pre_tokenizer(q);
      return;
    }
    Step s;
    if (type == "Split" && byte_level_seen)  // (tokenizers would show it byte-level characters)
      refuse("a Split pre-tokenizer after a ByteLevel one");
    if (type == "Split") {
      const Json& pat = p.at("pattern");
      const bool literal = pat.contains("String");
      s.regex = std::make_unique<Regex>(literal ? pat.at("String").get<std::string>() : pat.at("Regex").get<std::string>(),
                                        literal, path);
      const std::string b = p.value("behavior", "Isolated");
      if (b == "Isolated") s.behavior = Behavior::kIsolated;
      else if (b == "Removed") s.behavior = Behavior::kRemoved;
      else if (b == "MergedWithPrevious") s.behavior = Behavior::kMergedWithPrevious;
      else if (b == "MergedWithNext") s.behavior = Behavior::kMergedWithNext;
      else if (b == "Contiguous") s.behavior = Behavior::kContiguous;
      else refuse(fmt::format("pre-tokenizer Split with behavior {}", b));
      s.invert = p.value("invert", false);
    } else if (type == "ByteLevel") {
      s.prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) s.regex = std::make_unique<Regex>(kGpt2Pattern, false, path);
      byte_level_seen = true;
    } else {
      refuse(fmt::format("pre-tokenizer {}", type.empty() ? p.dump() : type));
    }
    steps.push_back(std::move(s));
  }

  // Splits each piece by one step (tokenizers' SplitDelimiterBehavior), dropping empty pieces.
  void apply(const Step& s, std::vector<std::string>& pieces) const {
    std::vector<std::string> out;
    std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;
    for (std::string& piece : pieces) {
      if (s.prefix_space && !piece.empty() && piece[0] != ' ') piece.insert(piece.begin(), ' ');
      if (!s.regex) {
        out.push_back(std::move(piece));
        continue;
      }
      s.regex->matches(piece, found);
      parts.clear();
      size_t prev = 0;
      for (const auto& [b, e] : found) {
        if (prev != b) parts.push_back({{prev, b}, s.invert});
        parts.push_back({{b, e}, !s.invert});
        prev = e;
      }
      if (prev != piece.size()) parts.push_back({{prev, piece.size()}, s.invert});
      std::vector<std::pair<size_t, size_t>> kept;
      bool previous = false;
      switch (s.behavior) {
        case Behavior::kIsolated:
          for (const auto& [o, m] : parts) kept.push_back(o);
          break;
        case Behavior::kRemoved:
          for (const auto& [o, m] : parts)
            if (!m) kept.push_back(o);
          break;
        case Behavior::kMergedWithPrevious:
          for (const auto& [o, m] : parts) {
            if (m && !previous && !kept.empty()) kept.back().second = o.second;
            else kept.push_back(o);
            previous = m;
          }
          break;
        case Behavior::kMergedWithNext: {
          for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
            if (it->second && !previous && !kept.empty()) kept.back().first = it->first.first;
            else kept.push_back(it->first);
            previous = it->second;
          }
          std::reverse(kept.begin(), kept.end());
          break;
        }
        case Behavior::kContiguous:
          for (const auto& [o, m] : parts) {
            if (m == previous && !kept.empty()) kept.back().second = o.second;
            else kept.push_back(o);
            previous = m;
          }
          break;
      }
      for (const auto& [b, e] : kept)
        if (e > b) out.push_back(piece.substr(b, e - b));
    }
    pieces = std::move(out);
  }

  // Byte-level BPE of one piece: merges of the lowest rank first, the leftmost of equal ranks —
  // a heap of (rank, position) over a linked list of symbols, O(n log n) in the piece's length,
  // as `tokenizers` merges. Pieces up to 256 bytes are cached.
  void bpe(const std::string& piece, std::vector<int32_t>& out) const {
    const bool cacheable = piece.size() <= 256;
    if (cacheable)
      if (const auto it = cache.find(piece); it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    std::vector<int32_t> w;
    if (ignore_merges) {
      std::string mapped;
      for (unsigned char c : piece) mapped += chars[c];
      if (const auto v = vocab.find(mapped); v != vocab.end()) w.push_back(v->second);
    }
    if (w.empty()) {
      const int64_t n = int64_t(piece.size());
      std::vector<int32_t> id(static_cast<size_t>(n)), next(static_cast<size_t>(n)), prev(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i)
        id[size_t(i)] = byte_id[static_cast<unsigned char>(piece[size_t(i)])], next[size_t(i)] = int32_t(i + 1),
                 prev[size_t(i)] = int32_t(i - 1);
      struct Cand {
        int32_t rank, pos, left, right;  // the pair (left, right) at pos when pushed
        bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
      };
      std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
      const auto push = [&](int32_t i) {
        if (i < 0) return;
        const int32_t j = next[size_t(i)];
        if (j >= n) return;
        const auto m = merges.find((uint64_t(uint32_t(id[size_t(i)])) << 32) | uint32_t(id[size_t(j)]));
        if (m != merges.end()) heap.push({m->second.first, i, id[size_t(i)], id[size_t(j)]});
      };
      for (int32_t i = 0; i + 1 < n; ++i) push(i);
      std::vector<char> dead(size_t(n), 0);
      while (!heap.empty()) {
        const Cand c = heap.top();
        heap.pop();
        const int32_t i = c.pos, j = next[size_t(i)];
        if (dead[size_t(i)] || j >= n || id[size_t(i)] != c.left || id[size_t(j)] != c.right) continue;  // stale
        id[size_t(i)] = merges.at((uint64_t(uint32_t(c.left)) << 32) | uint32_t(c.right)).second;
        dead[size_t(j)] = 1;
        next[size_t(i)] = next[size_t(j)];
        if (next[size_t(j)] < n) prev[size_t(next[size_t(j)])] = i;
        push(prev[size_t(i)]);
        push(i);
      }
      for (int32_t i = 0; i < n; i = next[size_t(i)]) w.push_back(id[size_t(i)]);
    }
    if (cacheable) {
      if (cache.size() > (size_t(1) << 18)) cache.clear();
      cache.emplace(piece, w);
    }
    out.insert(out.end(), w.begin(), w.end());
  }

  // Text without added tokens.
  void encode_plain(std::string_view text, std::vector<int32_t>& out) const {
    if (text.empty()) return;
    std::vector<std::string> pieces{std::string(text)};
    for (const Step& s : steps) apply(s, pieces);
    for (const std::string& p : pieces) bpe(p, out);
  }

  // The longest added token at `at` (with its stripped extent), or none.
  const Added* added_at(std::string_view text, size_t at, size_t& begin, size_t& end) const {
    for (const Added* ap : added_by_first[static_cast<unsigned char>(text[at])]) {
      const Added& a = *ap;
      if (text.compare(at, a.content.size(), a.content) != 0) continue;
      size_t b = at, e = at + a.content.size();
      if (a.single_word && ((b > 0 && is_word(text[b - 1])) || (e < text.size() && is_word(text[e])))) continue;
      if (a.lstrip)
        while (b > 0 && is_space(text[b - 1])) --b;
      if (a.rstrip)
        while (e < text.size() && is_space(text[e])) ++e;
      begin = b, end = e;
      return &a;
    }
    return nullptr;
  }

  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> out;
    size_t start = 0;  // of the text not yet encoded
    for (size_t at = 0; at < text.size(); ++at) {
      size_t b = 0, e = 0;
      const Added* a = added_by_first[static_cast<unsigned char>(text[at])].empty() ? nullptr : added_at(text, at, b, e);
      if (!a) continue;
      b = std::max(b, start);
      encode_plain(text.substr(start, b - start), out);
      out.push_back(a->id);
      start = e;
      at = e - 1;
    }
    encode_plain(text.substr(start), out);
    return out;
  }
};

HfTokenizer::HfTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HfTokenizer::~HfTokenizer() = default;

std::unique_ptr<HfTokenizer> HfTokenizer::load(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.path = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot be read", path));
  Json j;
  try {
    j = Json::parse(in);
  } catch (const Json::exception& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  try {
    if (!j.is_object() || !j.contains("model")) t.refuse("no \"model\" object (not a tokenizer.json)");
    const Json& m = j.at("model");
    // (GPT-2's file has no "type": tokenizers then infers it from the fields — merges: BPE)
    const std::string type = m.value("type", m.contains("merges") ? "BPE" : "");
    if (type != "BPE") t.refuse(fmt::format("model type {}", type.empty() ? "(none)" : type));
    if (m.value("byte_fallback", false)) t.refuse("byte_fallback (a SentencePiece-style BPE)");
    if (m.contains("dropout") && !m["dropout"].is_null()) t.refuse("BPE dropout");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && m[k] != "") t.refuse(fmt::format("BPE with a {}", k));
    t.ignore_merges = m.value("ignore_merges", false);
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const Json& n = j["normalizer"];
      if (!(n.value("type", "") == "Sequence" && n.value("normalizers", Json::array()).empty()))
        t.refuse(fmt::format("normalizer {}", n.value("type", n.dump())));
    }
    if (j.contains("pre_tokenizer")) t.parse_pre_tokenizer(j["pre_tokenizer"]);
    int32_t top = -1;
    for (const auto& [tok, id] : m.at("vocab").items()) {
      const int32_t i = t.checked_id(id, tok);
      t.vocab[tok] = i;
      top = std::max(top, i);
    }
    for (int b = 0; b < 256; ++b) {
      const auto it = t.vocab.find(t.chars[size_t(b)]);
      if (it == t.vocab.end()) t.refuse(fmt::format("the vocabulary lacks byte {:#04x}: not a byte-level BPE", b));
      t.byte_id[size_t(b)] = it->second;
      t.char_byte[t.chars[size_t(b)]] = static_cast<unsigned char>(b);
    }
    std::vector<int32_t> special;  // the ids of the special added tokens
    int32_t rank = 0;
    for (const Json& mg : m.at("merges")) {
      std::string left, right;
      if (mg.is_string()) {  // "left right"
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) t.refuse(fmt::format("merge {} is not two tokens", mg.dump()));
        left = s.substr(0, sp), right = s.substr(sp + 1);
      } else {  // ["left", "right"]
        left = mg.at(0).get<std::string>(), right = mg.at(1).get<std::string>();
      }
      const auto l = t.vocab.find(left), r = t.vocab.find(right), lr = t.vocab.find(left + right);
      if (l == t.vocab.end() || r == t.vocab.end() || lr == t.vocab.end())
        t.refuse(fmt::format("merge {} names a token outside the vocabulary", mg.dump()));
      t.merges.emplace((uint64_t(uint32_t(l->second)) << 32) | uint32_t(r->second), std::make_pair(rank++, lr->second));
    }
    for (const Json& a : j.value("added_tokens", Json::array())) {
      Added x;
      x.content = a.at("content").get<std::string>();
      x.id = t.checked_id(a.at("id"), x.content);
      x.lstrip = a.value("lstrip", false), x.rstrip = a.value("rstrip", false);
      x.single_word = a.value("single_word", false);
      top = std::max(top, x.id);
      if (a.value("special", false)) special.push_back(x.id);
      if (!x.content.empty()) t.added.push_back(x);
    }
    std::stable_sort(t.added.begin(), t.added.end(),
                     [](const Added& a, const Added& b) { return a.content.size() > b.content.size(); });
    for (const Added& a : t.added) t.added_by_first[static_cast<unsigned char>(a.content[0])].push_back(&a);
    t.size = int64_t(top) + 1;
    t.token_of.assign(size_t(t.size), std::string());
    t.is_added.assign(size_t(t.size), 0);
    for (const auto& [tok, id] : t.vocab) t.token_of[size_t(id)] = tok;
    for (const Added& a : t.added) t.token_of[size_t(a.id)] = a.content, t.is_added[size_t(a.id)] = 1;
    // The post-processor: TemplateProcessing's single sequence, or nothing added.
    if (j.contains("post_processor") && !j["post_processor"].is_null()) {
      const Json& p = j["post_processor"];
      const std::string pt = p.value("type", "");
      const Json* templ = nullptr;
      if (pt == "TemplateProcessing") {
        templ = &p;
      } else if (pt == "Sequence") {
        for (const Json& q : p.at("processors")) {
          const std::string qt = q.value("type", "");
          if (qt == "TemplateProcessing") templ = &q;
          else if (qt != "ByteLevel") t.refuse(fmt::format("post-processor {}", qt));
        }
      } else if (pt != "ByteLevel") {
        t.refuse(fmt::format("post-processor {}", pt));
      }
      if (templ) {
        bool seen_a = false;
        for (const Json& piece : templ->at("single")) {
          if (piece.contains("Sequence")) {
            seen_a = true;
            continue;
          }
          const std::string name = piece.at("SpecialToken").at("id").get<std::string>();
          for (const Json& id : templ->at("special_tokens").at(name).at("ids")) {
            const int32_t i = t.checked_id(id, name);
            if (i >= t.size) t.refuse(fmt::format("the post-processor's token {} has the id {}, outside the vocabulary", name, i));
            (seen_a ? t.suffix : t.prefix).push_back(i);
          }
        }
      }
    }
    // BOS / EOS: tokenizer_config.json's names, else the post-processor's leading token.
    // (beside it: tokenizer_config.json, or NAME.tokenizer_config.json for NAME.tokenizer.json,
    // as dstrain-prep copies the pair next to a dataset)
    std::string config_name = std::filesystem::path(path).filename().string();
    const std::string suffix = "tokenizer.json";
    config_name = config_name.size() >= suffix.size() && config_name.compare(config_name.size() - suffix.size(), suffix.size(), suffix) == 0
                      ? config_name.substr(0, config_name.size() - suffix.size()) + "tokenizer_config.json"
                      : "tokenizer_config.json";
    const std::filesystem::path config = std::filesystem::path(path).parent_path() / config_name;
    const auto id_of = [&](const Json& v) -> std::optional<int32_t> {
      const std::string s = v.is_object() ? v.value("content", "") : v.is_string() ? v.get<std::string>() : "";
      for (const Added& a : t.added)
        if (a.content == s) return a.id;
      if (const auto it = t.vocab.find(s); it != t.vocab.end()) return it->second;
      return std::nullopt;
    };
    if (std::filesystem::exists(config)) {
      std::ifstream cin(config);
      Json c;
      try {
        c = Json::parse(cin);
      } catch (const Json::exception& e) {
        throw ConfigError(fmt::format("{}: not valid JSON ({})", config.string(), e.what()));
      }
      if (c.contains("bos_token")) t.bos = id_of(c["bos_token"]);
      if (c.contains("eos_token")) t.eos = id_of(c["eos_token"]);
      // transformers' Llama-style flags: BOS before / EOS after every encoding, in place of the
      // post-processor's tokens.
      const bool add_bos = c.value("add_bos_token", false), add_eos = c.value("add_eos_token", false);
      if (c.contains("add_bos_token") || c.contains("add_eos_token")) {
        t.prefix.clear(), t.suffix.clear();
        if (add_bos && !t.bos) t.refuse("tokenizer_config.json sets add_bos_token but names no bos_token in the vocabulary");
        if (add_eos && !t.eos) t.refuse("tokenizer_config.json sets add_eos_token but names no eos_token in the vocabulary");
        if (add_bos) t.prefix.push_back(*t.bos);
        if (add_eos) t.suffix.push_back(*t.eos);
      }
    }
    if (!t.bos && !t.prefix.empty()) t.bos = t.prefix.front();
    // No names given (GPT-2's tokenizer_config.json has none: its class defaults BOS and EOS to
    // <|endoftext|>): a tokenizer with one special token uses it for both.
    if (special.size() == 1) {
      if (!t.bos) t.bos = special.front();
      if (!t.eos) t.eos = special.front();
    }
  } catch (const Json::exception& e) {
    throw ConfigError(fmt::format("{}: a field is missing or of the wrong type ({})", path, e.what()));
  }
  return std::unique_ptr<HfTokenizer>(new HfTokenizer(std::move(impl)));
}

int64_t HfTokenizer::vocab_size() const { return impl_->size; }

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const { return impl_->encode(text); }

std::vector<int32_t> HfTokenizer::encode_with_special(std::string_view text) const {
  std::vector<int32_t> out = impl_->prefix, body = impl_->encode(text);
  out.insert(out.end(), body.begin(), body.end());
  out.insert(out.end(), impl_->suffix.begin(), impl_->suffix.end());
  return out;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& t = *impl_;
  std::string out;
  for (const int32_t id : ids) {
    if (id < 0 || id >= t.size) throw ConfigError(fmt::format("{}: token id {} is outside the vocabulary", t.path, id));
    const std::string& tok = t.token_of[size_t(id)];
    if (t.is_added[size_t(id)]) {
      out += tok;
      continue;
    }
    for (size_t i = 0; i < tok.size();) {  // one byte-level character (1 or 2 UTF-8 bytes) per byte
      const size_t n = (static_cast<unsigned char>(tok[i]) & 0x80) ? 2 : 1;
      const auto it = t.char_byte.find(tok.substr(i, n));
      if (it == t.char_byte.end()) {
        out += tok.substr(i, n);
      } else {
        out += char(it->second);
      }
      i += n;
    }
  }
  return out;
}

std::optional<int32_t> HfTokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> HfTokenizer::eos_id() const { return impl_->eos; }

}  // namespace dstrain::data
