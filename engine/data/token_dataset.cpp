#include "engine/data/token_dataset.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/common/rng.h"
#include "engine/io/hdf5_file.h"

namespace dstrain::data {
namespace {

std::vector<int32_t> read_text_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot open the data file (data.path)", path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::vector<int32_t> read_prepared(const std::string& path, DatasetInfo& info) {
  io::H5File f(path, io::H5File::Mode::kRead);
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
  std::vector<int32_t> tokens;
  try {
    tokens = f.read_ints("tokens");
  } catch (const Error& e) {
    throw ConfigError(fmt::format("{}: the token data cannot be read (truncated or corrupt file?): {}", path, e.what()));
  }
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= info.vocab_size)
      throw ConfigError(fmt::format("{}: token {} at position {} is outside the dataset's vocab_size {}",
                                    path, tokens[i], i, info.vocab_size));
  return tokens;
}

}  // namespace

TokenDataset::TokenDataset(const config::TrainConfig& cfg) : S_(cfg.seq_length), seed_(uint64_t(cfg.seed)) {
  info_.path = cfg.data.path;
  tokens_ = cfg.data.format == config::DataFormat::kTokens ? read_prepared(cfg.data.path, info_) : read_text_bytes(cfg.data.path);
  info_.tokens = int64_t(tokens_.size());
  if (tokens_.empty()) throw ConfigError(fmt::format("{}: the data file is empty (data.path)", info_.path));
  if (cfg.data.format != config::DataFormat::kTokens) {  // text: the bytes present must fit the model
    const int32_t top = tokens_.empty() ? 0 : *std::max_element(tokens_.begin(), tokens_.end());
    if (top >= cfg.model.vocab_size)
      throw ConfigError(fmt::format("{}: the text holds byte {}, but model.vocab_size is {} (text is read as "
                                    "bytes, token id = byte value); valid: model.vocab_size > {}",
                                    info_.path, top, cfg.model.vocab_size, top));
  } else if (info_.vocab_size > cfg.model.vocab_size)
    throw ConfigError(fmt::format("{}: the data's vocabulary has {} tokens ({}), more than the "
                                  "model's vocab_size {}; valid: model.vocab_size >= {}",
                                  info_.path, info_.vocab_size, info_.tokenizer, cfg.model.vocab_size,
                                  info_.vocab_size));
  const int64_t n = info_.tokens;
  val_start_ = n - int64_t(double(n) * cfg.data.validation_fraction);
  info_.train_samples = (val_start_ - 1) / S_;
  info_.validation_samples = cfg.data.validation_fraction > 0 ? (n - val_start_ - 1) / S_ : 0;
  if (info_.train_samples < 1)
    throw ConfigError(fmt::format("{}: {} training tokens make no sample of seq_length + 1 = {} "
                                  "tokens; valid: more data or a shorter seq_length",
                                  info_.path, val_start_, S_ + 1));
  const int64_t batch = cfg.train_batch_size.value_or(1);
  if (batch > info_.train_samples)
    throw ConfigError(fmt::format("{}: train_batch_size {} sequences per step, but the data holds {} training "
                                  "samples of {} tokens (one step would pass over it {:.3g} times); valid: "
                                  "train_batch_size <= {}, or more data",
                                  info_.path, with_commas(batch), with_commas(info_.train_samples), S_ + 1,
                                  double(batch) / double(info_.train_samples), with_commas(info_.train_samples)));
  if (cfg.data.validation_fraction > 0 && info_.validation_samples < 1)
    throw ConfigError(fmt::format("{}: the validation split ({} tokens, data.validation_fraction "
                                  "{}) holds no sample of {} tokens; valid: a larger fraction, or 0 "
                                  "to train without validation",
                                  info_.path, n - val_start_, cfg.data.validation_fraction, S_ + 1));
}

const std::vector<int64_t>& TokenDataset::epoch_order(int64_t epoch) const {
  if (epoch == cached_epoch_) return order_;
  const int64_t n = info_.train_samples;
  order_.resize(n);
  for (int64_t i = 0; i < n; ++i) order_[i] = i;
  const uint64_t key = stream_key(seed_, "data.order." + std::to_string(epoch));
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates with counter-based draws
    const int64_t j = int64_t(uniform_at(key, uint64_t(i)) * double(i + 1));
    std::swap(order_[i], order_[std::min(j, i)]);
  }
  cached_epoch_ = epoch;
  return order_;
}

int64_t TokenDataset::train_sample_at(int64_t g) const {
  const int64_t n = info_.train_samples;
  return epoch_order(g / n)[g % n];
}

void TokenDataset::window(int32_t* out, int64_t split_start, int64_t sample) const {
  const int32_t* src = tokens_.data() + split_start + sample * S_;
  std::copy(src, src + S_ + 1, out);
}

void TokenDataset::train_batch(int32_t* out, int64_t first, int64_t count) const {
  for (int64_t i = 0; i < count; ++i) window(out + i * (S_ + 1), 0, train_sample_at(first + i));
}

void TokenDataset::validation_batch(int32_t* out, int64_t first, int64_t count) const {
  DS_CHECK(info_.validation_samples > 0, "no validation split");
  for (int64_t i = 0; i < count; ++i)
    window(out + i * (S_ + 1), val_start_, (first + i) % info_.validation_samples);
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
