// Tokenizers: bytes (token id = byte value, vocab 256) and a byte-level BPE that dstrain-prep
// trains and applies. Byte-level means every text round-trips exactly: decode(encode(t)) == t.
//
// BPE file format ("dstrain-bpe 1", text):
//   dstrain-bpe 1
//   vocab_size <V>
//   merges <M>
//   <left> <right>        M lines; merge i creates token 256 + i from the two token ids
// Pre-tokenisation (fixed, part of version 1): text is cut into chunks — an optional single
// space followed by a run of letters (bytes >= 0x80 count as letters), a run of digits, a run of
// other printable symbols, or a run of whitespace — and merges never cross a chunk boundary.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dstrain::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string name() const = 0;  // "bytes" or "bpe"
  virtual int64_t vocab_size() const = 0;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::string name() const override { return "bytes"; }
  int64_t vocab_size() const override { return 256; }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
};

class BpeTokenizer final : public Tokenizer {
 public:
  // Learns merges on `text` until the vocabulary has `vocab_size` tokens (>= 256) or no pair
  // occurs twice. Deterministic: ties go to the smallest (left, right) pair.
  static BpeTokenizer train(std::string_view text, int64_t vocab_size);
  static BpeTokenizer load(const std::string& path);  // throws dstrain::Error naming the file
  void save(const std::string& path) const;

  std::string name() const override { return "bpe"; }
  int64_t vocab_size() const override { return 256 + int64_t(merges_.size()); }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  const std::vector<std::pair<int32_t, int32_t>>& merges() const { return merges_; }

 private:
  void build_tables();
  std::vector<std::pair<int32_t, int32_t>> merges_;
  std::vector<std::string> bytes_of_;  // token id -> bytes
};

// Pre-tokenisation chunks (see the file comment), as views into `text`.
std::vector<std::string_view> pretokenize(std::string_view text);

}  // namespace dstrain::data
