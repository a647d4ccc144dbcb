// Training data: a token stream (raw text read as bytes, or a dataset prepared by dstrain-prep),
// split into train and validation, cut into samples of seq_length + 1 tokens, and visited in a
// seeded order that does not depend on the number of ranks (docs/design.md §2.4):
//   sample windows: sample i covers tokens [i*S, i*S + S + 1) of its split (inputs and targets);
//   order: epoch e is a Philox-seeded permutation of the train samples (seed, e);
//   step s trains on global positions [s*G, (s+1)*G) of the epoch-concatenated order;
//   data-parallel rank r takes positions [r*G/DP, (r+1)*G/DP) of those, micro-batch m the
//   positions [m*micro, (m+1)*micro) of its share.
// The position in the data is therefore the step number: resuming at step s is exact.
//
// Prepared dataset format ("dstrain-tokens", version 1, HDF5):
//   dataset /tokens          int32 [n]   the token stream (documents concatenated)
//   attributes format = "dstrain-tokens", version = 1, vocab_size, tokenizer ("bytes" | "bpe"),
//              tokenizer_file (path relative to the dataset, for "bpe"), sources (text)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/train_config.h"

namespace dstrain::data {

struct DatasetInfo {
  std::string path, tokenizer = "bytes", tokenizer_file;
  // What identifies the tokenization: "bytes", or "bpe:" and a hash of the tokenizer file's
  // contents (checkpoints record it; resuming on data tokenized otherwise is refused).
  std::string tokenizer_id = "bytes";
  int64_t vocab_size = 256;
  int64_t tokens = 0, train_samples = 0, validation_samples = 0;
};

class TokenDataset {
 public:
  // Reads data.path per data.format; checks it against the model's vocabulary and seq_length.
  // Throws ConfigError naming the file and what is wrong.
  explicit TokenDataset(const config::TrainConfig& cfg);

  const DatasetInfo& info() const { return info_; }
  int64_t seq_length() const { return S_; }

  // The train sample at global position `g` of the seeded order (any number of epochs).
  int64_t train_sample_at(int64_t g) const;

  // Tokens [count, S+1] of `count` consecutive global positions starting at `first`.
  void train_batch(int32_t* out, int64_t first, int64_t count) const;
  // Validation samples in file order, wrapping around: positions [first, first + count).
  void validation_batch(int32_t* out, int64_t first, int64_t count) const;

  // Global position of the first sample of (step, dp rank, micro-batch) — the fixed split.
  static int64_t position(int64_t step, int64_t global_batch, int64_t dp_rank, int64_t dp_size,
                          int64_t micro_batch, int64_t micro_size);

 private:
  const std::vector<int64_t>& epoch_order(int64_t epoch) const;
  void window(int32_t* out, int64_t split_start, int64_t sample) const;

  DatasetInfo info_;
  int64_t S_ = 0;
  uint64_t seed_ = 0;
  std::vector<int32_t> tokens_;
  int64_t val_start_ = 0;  // first token of the validation split
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

// Writes a prepared dataset (dstrain-prep).
void write_token_dataset(const std::string& path, const std::vector<int32_t>& tokens,
                         int64_t vocab_size, const std::string& tokenizer,
                         const std::string& tokenizer_file, const std::string& sources);

}  // namespace dstrain::data
