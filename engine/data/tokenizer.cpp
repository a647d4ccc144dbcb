#include "engine/data/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <queue>
#include <set>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>

#include "engine/common/error.h"

namespace dstrain::data {
namespace {

enum class Kind { kLetter, kDigit, kSpace, kOther };

Kind kind(unsigned char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80) return Kind::kLetter;
  if (c >= '0' && c <= '9') return Kind::kDigit;
  if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f') return Kind::kSpace;
  return Kind::kOther;
}

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

}  // namespace

std::vector<std::string_view> pretokenize(std::string_view text) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t start = i;
    // A single space joins the word, number or symbol run that follows it.
    if (text[i] == ' ' && i + 1 < text.size() && kind(text[i + 1]) != Kind::kSpace) ++i;
    const Kind k = kind(text[i]);
    while (i < text.size() && kind(text[i]) == k) ++i;
    if (k == Kind::kSpace && i < text.size() && i - start > 1 && text[i - 1] == ' ') --i;
    out.push_back(text.substr(start, i - start));
  }
  return out;
}

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) out[i] = char(ids[i]);
  return out;
}

// Training works on unique chunks with their counts; each merge updates only the chunks that
// hold the merged pair (an index from pair to chunks), and a max-heap with lazy deletion
// finds the most frequent pair.
BpeTokenizer BpeTokenizer::train(std::string_view text, int64_t vocab_size) {
  if (vocab_size < 256)
    throw ConfigError(fmt::format("BPE vocab_size {} is below the 256 byte tokens", vocab_size));
  std::unordered_map<std::string_view, int64_t> chunk_counts;
  for (std::string_view c : pretokenize(text)) ++chunk_counts[c];
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  std::vector<std::string_view> keys;
  for (const auto& [c, n] : chunk_counts) keys.push_back(c);
  std::sort(keys.begin(), keys.end());  // deterministic word order
  for (std::string_view c : keys) {
    std::vector<int32_t> w(c.size());
    for (size_t i = 0; i < c.size(); ++i) w[i] = static_cast<unsigned char>(c[i]);
    words.push_back(std::move(w));
    freq.push_back(chunk_counts[c]);
  }
  std::unordered_map<uint64_t, int64_t> counts;
  std::unordered_map<uint64_t, std::set<int32_t>> where;
  for (int32_t wi = 0; wi < int32_t(words.size()); ++wi)
    for (size_t i = 0; i + 1 < words[wi].size(); ++i) {
      const uint64_t k = pair_key(words[wi][i], words[wi][i + 1]);
      counts[k] += freq[wi];
      where[k].insert(wi);
    }
  // Heap of (count, -key): larger count first, then the smaller pair.
  std::priority_queue<std::pair<int64_t, int64_t>> heap;
  for (const auto& [k, n] : counts) heap.push({n, -int64_t(k)});
  BpeTokenizer tok;
  while (tok.vocab_size() < vocab_size && !heap.empty()) {
    const auto [n, neg] = heap.top();
    heap.pop();
    const uint64_t k = uint64_t(-neg);
    const auto it = counts.find(k);
    if (it == counts.end() || it->second != n) continue;  // stale entry
    if (n < 2) break;
    const int32_t a = int32_t(k >> 32), b = int32_t(uint32_t(k)), merged = int32_t(tok.vocab_size());
    tok.merges_.push_back({a, b});
    const std::set<int32_t> affected = where[k];
    std::map<uint64_t, int64_t> delta;
    for (int32_t wi : affected) {
      std::vector<int32_t>& w = words[wi];
      for (size_t i = 0; i + 1 < w.size(); ++i) delta[pair_key(w[i], w[i + 1])] -= freq[wi];
      std::vector<int32_t> next;
      for (size_t i = 0; i < w.size(); ++i) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) {
          next.push_back(merged);
          ++i;
        } else {
          next.push_back(w[i]);
        }
      }
      w = std::move(next);
      for (size_t i = 0; i + 1 < w.size(); ++i) {
        const uint64_t pk = pair_key(w[i], w[i + 1]);
        delta[pk] += freq[wi];
        where[pk].insert(wi);
      }
    }
    for (const auto& [pk, d] : delta) {
      if (d == 0) continue;
      int64_t& c = counts[pk];
      c += d;
      if (c > 0) heap.push({c, -int64_t(pk)});
      else counts.erase(pk);
    }
  }
  tok.build_tables();
  return tok;
}

void BpeTokenizer::build_tables() {
  bytes_of_.assign(256, std::string());
  for (int i = 0; i < 256; ++i) bytes_of_[i] = std::string(1, char(i));
  for (const auto& [a, b] : merges_) bytes_of_.push_back(bytes_of_.at(a) + bytes_of_.at(b));
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  std::unordered_map<uint64_t, int32_t> rank;  // pair -> merge index
  for (int32_t i = 0; i < int32_t(merges_.size()); ++i) rank[pair_key(merges_[i].first, merges_[i].second)] = i;
  std::unordered_map<std::string_view, std::vector<int32_t>> cache;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  for (std::string_view chunk : pretokenize(text)) {
    auto hit = cache.find(chunk);
    if (hit == cache.end()) {
      std::vector<int32_t> w(chunk.size());
      for (size_t i = 0; i < chunk.size(); ++i) w[i] = static_cast<unsigned char>(chunk[i]);
      while (w.size() > 1) {  // apply the earliest-learned merge present, as training did
        int32_t best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < w.size(); ++i) {
          const auto r = rank.find(pair_key(w[i], w[i + 1]));
          if (r != rank.end() && (best < 0 || r->second < best)) best = r->second, at = i;
        }
        if (best < 0) break;
        const auto [a, b] = merges_[best];
        std::vector<int32_t> next;
        for (size_t i = 0; i < w.size(); ++i) {
          if (i >= at && i + 1 < w.size() && w[i] == a && w[i + 1] == b) {
            next.push_back(256 + best);
            ++i;
          } else {
            next.push_back(w[i]);
          }
        }
        w = std::move(next);
      }
      hit = cache.emplace(chunk, std::move(w)).first;
    }
    out.insert(out.end(), hit->second.begin(), hit->second.end());
  }
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= int32_t(bytes_of_.size()))
      throw Error(fmt::format("token id {} outside the BPE vocabulary of {}", id, bytes_of_.size()));
    out += bytes_of_[id];
  }
  return out;
}

void BpeTokenizer::save(const std::string& path) const {
  std::ofstream out(path);
  if (!out) throw Error(fmt::format("{}: cannot write the tokenizer", path));
  out << "dstrain-bpe 1\nvocab_size " << vocab_size() << "\nmerges " << merges_.size() << "\n";
  for (const auto& [a, b] : merges_) out << a << " " << b << "\n";
  if (!out.flush()) throw Error(fmt::format("{}: write failed", path));
}

BpeTokenizer BpeTokenizer::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the tokenizer file", path));
  std::string magic, key;
  int version = 0;
  int64_t vocab = 0, count = 0;
  in >> magic >> version >> key >> vocab;
  if (magic != "dstrain-bpe" || key != "vocab_size")
    throw ConfigError(fmt::format("{}: not a dstrain BPE tokenizer (first line should be 'dstrain-bpe 1')", path));
  if (version != 1)
    throw ConfigError(fmt::format("{}: tokenizer format version {}; this dstrain reads version 1", path, version));
  in >> key >> count;
  if (key != "merges" || count != vocab - 256)
    throw ConfigError(fmt::format("{}: header says vocab_size {} but {} merges", path, vocab, count));
  BpeTokenizer tok;
  for (int64_t i = 0; i < count; ++i) {
    int32_t a = -1, b = -1;
    if (!(in >> a >> b) || a < 0 || b < 0 || a >= 256 + i || b >= 256 + i)
      throw ConfigError(fmt::format("{}: merge {} is missing or refers to an unknown token (truncated file?)", path, i));
    tok.merges_.push_back({a, b});
  }
  tok.build_tables();
  return tok;
}

}  // namespace dstrain::data
