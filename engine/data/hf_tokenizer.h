// Hugging Face tokenizers (`tokenizer.json`) of the byte-level BPE kind — GPT-2's, DeepSeek-V2 /
// V3's, and the like — applied as the `tokenizers` library applies them (docs/guide.md, "Hugging
// Face tokenizers"): added and special tokens cut out of the text first (longest match; lstrip /
// rstrip / single_word honoured), the pre-tokeniser — Split (regex or literal; Isolated, Removed,
// MergedWithPrevious, MergedWithNext, Contiguous; invert) and ByteLevel (add_prefix_space,
// use_regex with GPT-2's pattern), in a Sequence or alone — then byte-level BPE on each piece
// (merge ranks, ignore_merges), and with special tokens the post-processor's template
// (TemplateProcessing's single sequence: BOS and the like). The regular expressions run on PCRE2
// with Unicode properties (\p{L}, \p{N}, ...), as Oniguruma runs them for `tokenizers`.
//
// Anything else — another model (WordPiece, Unigram, WordLevel), a normaliser (NFC, lowercase,
// ...), byte_fallback, dropout, subword prefixes or suffixes, other pre-tokenisers — is refused
// with one line naming the file and the part, never approximated.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/data/tokenizer.h"

namespace dstrain::data {

// Encoding keeps a cache of the pieces it has seen: one HfTokenizer per thread.
class HfTokenizer final : public Tokenizer {
 public:
  // `path`: a tokenizer.json. tokenizer_config.json beside it, where present, names the BOS / EOS
  // tokens (bos_token, eos_token), and its add_bos_token / add_eos_token, where given, decide
  // what encode_with_special adds (as transformers' Llama-style tokenizers do) in place of the
  // post-processor. Without names there, a tokenizer with a single special token (GPT-2's
  // <|endoftext|>) uses it as BOS and EOS, as transformers' GPT-2 class does. Throws ConfigError
  // naming the file.
  static std::unique_ptr<HfTokenizer> load(const std::string& path);
  ~HfTokenizer() override;

  std::string name() const override { return "hf"; }
  // One more than the largest id of the vocabulary and the added tokens.
  int64_t vocab_size() const override;
  // transformers' encode(text, add_special_tokens=False).
  std::vector<int32_t> encode(std::string_view text) const override;
  // encode(text, add_special_tokens=True): the post-processor's tokens around the text.
  std::vector<int32_t> encode_with_special(std::string_view text) const;
  // Every token as its text (special ones included), the byte-level ones mapped back to bytes.
  std::string decode(const std::vector<int32_t>& ids) const override;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;

 private:
  struct Impl;
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dstrain::data
