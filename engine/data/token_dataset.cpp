#include "engine/data/token_dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/common/rng.h"
#include "engine/config/load_config.h"
#include "engine/data/indexed_dataset.h"
#include "engine/io/hdf5_file.h"

namespace dstrain::data {
namespace {

// Raw text, in memory: token id = byte value.
class TextSource : public TokenDataset::Source {
 public:
  explicit TextSource(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw ConfigError(fmt::format("{}: cannot open the data file (data.path)", path));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ids_.resize(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids_[i] = static_cast<unsigned char>(text[i]);
  }
  int64_t size() const override { return int64_t(ids_.size()); }
  void read(int64_t first, int64_t n, int32_t* out) const override {
    std::copy(ids_.begin() + first, ids_.begin() + first + n, out);
  }
  int32_t max() const { return ids_.empty() ? 0 : *std::max_element(ids_.begin(), ids_.end()); }

 private:
  std::vector<int32_t> ids_;
};

// A dstrain-prep dataset: /tokens read a window at a time (an HDF5 hyperslab), each token
// checked against the dataset's vocabulary as it is read.
class Hdf5Source : public TokenDataset::Source {
 public:
  Hdf5Source(std::unique_ptr<io::H5File> f, std::string path, int64_t n, int64_t vocab)
      : f_(std::move(f)), path_(std::move(path)), n_(n), vocab_(vocab) {}
  int64_t size() const override { return n_; }
  void read(int64_t first, int64_t n, int32_t* out) const override {
    try {
      f_->read_ints("tokens", first, n, out);
    } catch (const Error& e) {
      throw ConfigError(fmt::format("{}: the token data cannot be read (truncated or corrupt file?): {}", path_,
                                    e.what()));
    }
    for (int64_t i = 0; i < n; ++i)
      if (out[i] < 0 || out[i] >= vocab_)
        throw ConfigError(fmt::format("{}: token {} at position {} is outside the dataset's vocab_size {}", path_,
                                      out[i], first + i, vocab_));
  }

 private:
  std::unique_ptr<io::H5File> f_;
  std::string path_;
  int64_t n_, vocab_;
};

// Megatron-LM's indexed format (PREFIX.idx + PREFIX.bin), a positioned read per window.
class MegatronSource : public TokenDataset::Source {
 public:
  MegatronSource(const MegatronIndex& idx, int64_t vocab) : reader_(idx), vocab_(vocab) {}
  int64_t size() const override { return reader_.index().tokens; }
  void read(int64_t first, int64_t n, int32_t* out) const override { reader_.read(first, n, vocab_, out); }

 private:
  MegatronReader reader_;
  int64_t vocab_;
};

std::unique_ptr<TokenDataset::Source> open_prepared(const std::string& path, DatasetInfo& info) {
  auto file = std::make_unique<io::H5File>(path, io::H5File::Mode::kRead);
  io::H5File& f = *file;
  std::string format;
  try {
    format = f.attr_string("format");
  } catch (const Error&) {
  }
  if (format != "dstrain-tokens")
    throw ConfigError(fmt::format("{}: not a dstrain token dataset (no format = \"dstrain-tokens\" "
                                  "attribute); make one with dstrain-prep",
                                  path));
  const double version = f.attr_double("version");
  if (version != 1.0)
    throw ConfigError(fmt::format("{}: dataset format version {}; this dstrain reads version 1", path, version));
  info.vocab_size = int64_t(f.attr_double("vocab_size"));
  info.tokenizer = f.attr_string("tokenizer");
  info.tokenizer_file = f.attr_string("tokenizer_file");
  // dstrain-prep writes the tokenizer next to the dataset and records its bare file name: a path
  // (elsewhere, "..") is refused rather than read.
  const std::string& tf = info.tokenizer_file;
  if (!tf.empty() && (tf == "." || tf == ".." || tf.find('/') != std::string::npos ||
                      std::any_of(tf.begin(), tf.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; })))
    throw ConfigError(fmt::format("{}: its tokenizer_file attribute \"{}\" is not a file name next to the dataset "
                                  "(dstrain-prep writes DATA.tokenizer beside DATA.h5); valid: a bare file name",
                                  path, printable(tf, 120)));
  info.tokenizer_id = info.tokenizer;
  if (!info.tokenizer_file.empty()) {  // FNV-1a of the tokenizer file (next to the dataset)
    std::ifstream in(std::filesystem::path(path).parent_path() / info.tokenizer_file, std::ios::binary);
    uint64_t h = 1469598103934665603ull;
    bool any = false;
    for (char c; in.get(c); any = true) h = (h ^ uint64_t(static_cast<unsigned char>(c))) * 1099511628211ull;
    info.tokenizer_id += any ? fmt::format(":{:016x}", h) : ":" + info.tokenizer_file;
  }
  if (!f.exists("tokens")) throw ConfigError(fmt::format("{}: no /tokens dataset", path));
  const std::vector<int64_t> shape = f.shape("tokens");
  if (shape.size() != 1) throw ConfigError(fmt::format("{}: /tokens is not one-dimensional", path));
  int32_t probe = 0;  // the first and last tokens: a file cut short fails here, at start
  try {
    if (shape[0] > 0) f.read_ints("tokens", 0, 1, &probe), f.read_ints("tokens", shape[0] - 1, 1, &probe);
  } catch (const Error& e) {
    throw ConfigError(fmt::format("{}: the token data cannot be read (truncated or corrupt file?): {}", path, e.what()));
  }
  return std::make_unique<Hdf5Source>(std::move(file), path, shape[0], info.vocab_size);
}

}  // namespace

// A balanced Feistel network of four rounds on the smallest even number of bits that covers n,
// walking the cycle until the value falls in [0, n) (the domain is below 4n, so a few steps).
int64_t permuted_index(uint64_t key, int64_t n, int64_t i) {
  DS_CHECK(n > 0 && i >= 0 && i < n, "permuted_index({}) of {}", i, n);
  if (n == 1) return 0;
  int bits = 64 - __builtin_clzll(uint64_t(n - 1));
  bits += bits & 1;
  const int half = bits / 2;
  const uint64_t mask = (uint64_t(1) << half) - 1;
  uint64_t x = uint64_t(i);
  do {
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = uint64_t(uniform_at(key, (round << 58) ^ r) * double(uint64_t(1) << 53)) & mask;
      const uint64_t next = l ^ f;
      l = r, r = next;
    }
    x = (l << half) | r;
  } while (x >= uint64_t(n));
  return int64_t(x);
}

TokenDataset::~TokenDataset() = default;

// One dataset of the blend: its source, its split and its sample counts, checked.
TokenDataset::Part TokenDataset::open_part(const config::TrainConfig& cfg, const std::string& path, double weight) {
  Part p;
  p.weight = weight;
  DatasetInfo& info = p.info;
  info.path = path;
  const config::DataFormat format = config::data_format_of(path, cfg.data.format);
  if (format == config::DataFormat::kTokens) {
    p.source = open_prepared(path, info);
  } else if (format == config::DataFormat::kMegatron) {
    const MegatronIndex idx = read_megatron_index(config::megatron_prefix(path));
    // Megatron's files name no tokenizer: the model's vocabulary bounds the ids (checked as read).
    info.tokenizer = "megatron";
    info.tokenizer_id = fmt::format("megatron:{}", idx.itemsize * 8);
    info.vocab_size = cfg.model.vocab_size;
    info.documents = std::max<int64_t>(0, idx.documents - 1);  // (the index lists D + 1 boundaries)
    p.source = std::make_unique<MegatronSource>(idx, cfg.model.vocab_size);
  } else {
    auto text = std::make_unique<TextSource>(path);
    const int32_t top = text->max();
    if (text->size() > 0 && top >= cfg.model.vocab_size)  // text: the bytes present must fit the model
      throw ConfigError(fmt::format("{}: the text holds byte {}, but model.vocab_size is {} (text is read as "
                                    "bytes, token id = byte value); valid: model.vocab_size > {}",
                                    path, top, cfg.model.vocab_size, top));
    p.source = std::move(text);
  }
  info.tokens = p.source->size();
  if (info.tokens == 0) throw ConfigError(fmt::format("{}: the data file is empty (data.path)", path));
  if (format == config::DataFormat::kTokens && info.vocab_size > cfg.model.vocab_size)
    throw ConfigError(fmt::format("{}: the data's vocabulary has {} tokens ({}), more than the "
                                  "model's vocab_size {}; valid: model.vocab_size >= {}",
                                  path, info.vocab_size, info.tokenizer, cfg.model.vocab_size, info.vocab_size));
  const int64_t n = info.tokens;
  p.val_start = n - int64_t(double(n) * cfg.data.validation_fraction);
  info.train_samples = (p.val_start - 1) / S_;
  info.validation_samples = cfg.data.validation_fraction > 0 ? (n - p.val_start - 1) / S_ : 0;
  if (info.train_samples < 1)
    throw ConfigError(fmt::format("{}: {} training tokens make no sample of seq_length + 1 = {} "
                                  "tokens; valid: more data or a shorter seq_length",
                                  path, p.val_start, S_ + 1));
  if (cfg.data.validation_fraction > 0 && info.validation_samples < 1)
    throw ConfigError(fmt::format("{}: the validation split ({} tokens, data.validation_fraction "
                                  "{}) holds no sample of {} tokens; valid: a larger fraction, or 0 "
                                  "to train without validation",
                                  path, n - p.val_start, cfg.data.validation_fraction, S_ + 1));
  return p;
}

TokenDataset::TokenDataset(const config::TrainConfig& cfg) : S_(cfg.seq_length), seed_(uint64_t(cfg.seed)) {
  for (const auto& [w, path] : config::data_blend(cfg)) parts_.push_back(open_part(cfg, path, w));
  info_ = parts_[0].info;
  for (size_t d = 1; d < parts_.size(); ++d) {
    const DatasetInfo& o = parts_[d].info;
    if (o.tokenizer_id != info_.tokenizer_id || o.vocab_size != info_.vocab_size)
      throw ConfigError(fmt::format("data.paths: {} is tokenized as {} (vocabulary {}), {} as {} (vocabulary {}); a "
                                    "blend needs one tokenization; valid: datasets prepared with the same tokenizer",
                                    info_.path, info_.tokenizer_id, info_.vocab_size, o.path, o.tokenizer_id,
                                    o.vocab_size));
    info_.path += ", " + o.path;
    info_.tokens += o.tokens, info_.documents += o.documents;
    info_.train_samples += o.train_samples, info_.validation_samples += o.validation_samples;
  }
  const int64_t batch = cfg.train_batch_size.value_or(1);
  if (batch > info_.train_samples)
    throw ConfigError(fmt::format("{}: train_batch_size {} sequences per step, but the data holds {} training "
                                  "samples of {} tokens (one step would pass over it {:.3g} times); valid: "
                                  "train_batch_size <= {}, or more data",
                                  info_.path, with_commas(batch), with_commas(info_.train_samples), S_ + 1,
                                  double(batch) / double(info_.train_samples), with_commas(info_.train_samples)));
}

std::vector<TokenDataset::Share> TokenDataset::blend() const {
  std::vector<Share> out;
  for (const Part& p : parts_) out.push_back({p.weight, p.info});
  return out;
}

// Megatron's blending rule (its build_blending_indices): position i goes to the dataset whose
// count lags its weight's share the most — weight * max(i, 1) - count, the first on ties — and
// is that dataset's count-th sample. Walked forward from a cursor (positions are asked for in
// increasing order while training; an earlier one restarts the walk from 0).
TokenDataset::Pick TokenDataset::pick(Cursor& c, int64_t g, bool validation) const {
  if (parts_.size() == 1) return {0, g};
  if (g < c.next || c.counts.empty()) c.next = 0, c.counts.assign(parts_.size(), 0);
  Pick out{};
  for (; c.next <= g; ++c.next) {
    const double at = std::max(double(c.next), 1.0);
    size_t best = parts_.size();
    double most = 0;
    for (size_t d = 0; d < parts_.size(); ++d) {
      if (validation && parts_[d].info.validation_samples == 0) continue;
      const double err = parts_[d].weight * at - double(c.counts[d]);
      if (best == parts_.size() || err > most) best = d, most = err;
    }
    if (c.next == g) out = {int(best), c.counts[best]};
    ++c.counts[best];
  }
  return out;
}

int64_t TokenDataset::epoch_sample(int d, int64_t j) const {
  const int64_t n = parts_[size_t(d)].info.train_samples;
  const std::string stream = d == 0 ? fmt::format("data.order.{}", j / n) : fmt::format("data.order.{}.{}", d, j / n);
  return permuted_index(stream_key(seed_, stream), n, j % n);
}

int64_t TokenDataset::train_sample_at(int64_t g) const {
  const Pick p = pick(train_cursor_, g, false);
  return epoch_sample(p.dataset, p.index);
}

std::pair<int, int64_t> TokenDataset::train_sample(int64_t g) const {
  const Pick p = pick(train_cursor_, g, false);
  return {p.dataset, epoch_sample(p.dataset, p.index)};
}

void TokenDataset::window(int32_t* out, int d, int64_t split_start, int64_t sample) const {
  parts_[size_t(d)].source->read(split_start + sample * S_, S_ + 1, out);
}

void TokenDataset::train_batch(int32_t* out, int64_t first, int64_t count) const {
  for (int64_t i = 0; i < count; ++i) {
    const Pick p = pick(train_cursor_, first + i, false);
    window(out + i * (S_ + 1), p.dataset, 0, epoch_sample(p.dataset, p.index));
  }
}

void TokenDataset::validation_batch(int32_t* out, int64_t first, int64_t count) const {
  DS_CHECK(info_.validation_samples > 0, "no validation split");
  for (int64_t i = 0; i < count; ++i) {
    const Pick p = pick(validation_cursor_, first + i, true);
    const Part& part = parts_[size_t(p.dataset)];
    window(out + i * (S_ + 1), p.dataset, part.val_start, p.index % part.info.validation_samples);
  }
}

int64_t TokenDataset::position(int64_t step, int64_t global_batch, int64_t dp_rank, int64_t dp_size,
                               int64_t micro_batch, int64_t micro_size) {
  return step * global_batch + dp_rank * (global_batch / dp_size) + micro_batch * micro_size;
}

void write_token_dataset(const std::string& path, const std::vector<int32_t>& tokens,
                         int64_t vocab_size, const std::string& tokenizer,
                         const std::string& tokenizer_file, const std::string& sources) {
  io::H5File f(path, io::H5File::Mode::kCreate);
  f.write("tokens", tokens.data(), {int64_t(tokens.size())});
  f.set_attr("format", std::string("dstrain-tokens"));
  f.set_attr("version", 1.0);
  f.set_attr("vocab_size", double(vocab_size));
  f.set_attr("tokenizer", tokenizer);
  f.set_attr("tokenizer_file", tokenizer_file);
  f.set_attr("sources", sources);
}

}  // namespace dstrain::data
