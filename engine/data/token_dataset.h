// Training data: a token stream (raw text read as bytes, a dataset prepared by dstrain-prep, or
// Megatron-LM's indexed format: engine/data/indexed_dataset.h), split into train and validation,
// cut into samples of seq_length + 1 tokens, and visited in a seeded order that does not depend
// on the number of ranks (docs/design.md §2.4):
//   sample windows: sample i covers tokens [i*S, i*S + S + 1) of its split (inputs and targets),
//     across document boundaries (the documents' EOD tokens, where the preparation wrote them,
//     stay in the stream), as Megatron's GPT dataset cuts its samples;
//   order: epoch e is a keyed pseudo-random permutation of the train samples (seed, e), computed
//     per position (a Feistel network), so that no per-sample table is held;
//   step s trains on global positions [s*G, (s+1)*G) of the epoch-concatenated order;
//   data-parallel rank r takes positions [r*G/DP, (r+1)*G/DP) of those, micro-batch m the
//   positions [m*micro, (m+1)*micro) of its share.
// The position in the data is therefore the step number: resuming at step s is exact. Token
// files are read a window at a time (never whole): the memory a dataset takes does not grow with
// it. Raw text is read into memory (the demo's format).
//
// Prepared dataset format ("dstrain-tokens", version 1, HDF5):
//   dataset /tokens          int32 [n]   the token stream (documents concatenated)
//   attributes format = "dstrain-tokens", version = 1, vocab_size, tokenizer ("bytes" | "bpe"),
//              tokenizer_file (path relative to the dataset, for "bpe"), sources (text)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
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
  int64_t documents = 0;  // where the format records them (Megatron's index), else 0
};

class TokenDataset {
 public:
  // Reads data.path (or the blend data.paths) per data.format; checks it against the model's
  // vocabulary and seq_length. Throws ConfigError naming the file and what is wrong.
  explicit TokenDataset(const config::TrainConfig& cfg);
  ~TokenDataset();

  // The whole data (a blend: the datasets' paths joined, their counts summed).
  const DatasetInfo& info() const { return info_; }
  int64_t seq_length() const { return S_; }
  // The blend's datasets with their normalised weights (one, weight 1, without data.paths).
  struct Share {
    double weight;
    DatasetInfo info;
  };
  std::vector<Share> blend() const;

  // The train sample at global position `g` of the seeded order (any number of epochs), as an
  // index into its dataset's samples — and which dataset (a blend's positions go to the datasets
  // by Megatron's blending rule; each dataset has its own epochs and order).
  int64_t train_sample_at(int64_t g) const;
  std::pair<int, int64_t> train_sample(int64_t g) const;

  // Tokens [count, S+1] of `count` consecutive global positions starting at `first`.
  void train_batch(int32_t* out, int64_t first, int64_t count) const;
  // Validation samples in file order, wrapping around: positions [first, first + count) (a
  // blend's go to its datasets by the same rule).
  void validation_batch(int32_t* out, int64_t first, int64_t count) const;

  // Global position of the first sample of (step, dp rank, micro-batch) — the fixed split.
  static int64_t position(int64_t step, int64_t global_batch, int64_t dp_rank, int64_t dp_size,
                          int64_t micro_batch, int64_t micro_size);

  // Where the tokens come from: elements [first, first + n) of the stream into out.
  class Source {
   public:
    virtual ~Source() = default;
    virtual int64_t size() const = 0;
    virtual void read(int64_t first, int64_t n, int32_t* out) const = 0;
  };

 private:
  struct Part {
    double weight = 1;
    DatasetInfo info;
    std::unique_ptr<Source> source;
    int64_t val_start = 0;  // first token of its validation split
  };
  struct Cursor {  // the blending walk: the next position and the samples each dataset has had
    int64_t next = 0;
    std::vector<int64_t> counts;
  };
  struct Pick {
    int dataset;
    int64_t index;  // the dataset's index-th sample of the blend
  };
  Part open_part(const config::TrainConfig& cfg, const std::string& path, double weight);
  Pick pick(Cursor& c, int64_t g, bool validation) const;
  int64_t epoch_sample(int d, int64_t j) const;
  void window(int32_t* out, int d, int64_t split_start, int64_t sample) const;

  DatasetInfo info_;
  int64_t S_ = 0;
  uint64_t seed_ = 0;
  std::vector<Part> parts_;
  mutable Cursor train_cursor_, validation_cursor_;
};

// A keyed bijection of [0, n) (the sample order of one epoch): element i of the permutation.
int64_t permuted_index(uint64_t key, int64_t n, int64_t i);

// Writes a prepared dataset (dstrain-prep).
void write_token_dataset(const std::string& path, const std::vector<int32_t>& tokens,
                         int64_t vocab_size, const std::string& tokenizer,
                         const std::string& tokenizer_file, const std::string& sources);

}  // namespace dstrain::data
