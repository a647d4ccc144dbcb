// libFuzzer target: the tokenizer and token-dataset readers. The input is used three ways:
//  1. as a BPE tokenizer file ("dstrain-bpe 1"): loading it must succeed or throw dstrain::Error;
//     a loaded tokenizer must round-trip any text exactly;
//  2. as text: a BPE trained on it must round-trip it exactly (decode(encode(t)) == t), as must
//     the byte tokenizer;
//  3. as a data file for TokenDataset (text, read as bytes): loading and cutting samples must
//     succeed or end in a ConfigError naming the file.
// Run from the repository root.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "engine/common/error.h"
#include "engine/config/load_config.h"
#include "engine/data/token_dataset.h"
#include "engine/data/tokenizer.h"

namespace {

std::string temp_file(const std::string& what, const uint8_t* data, size_t size) {
  const std::string path = "/tmp/dstrain-fuzz-" + what + "-" + std::to_string(getpid());
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dstrain::data;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string path = temp_file("tok", data, size);
  try {
    const BpeTokenizer loaded = BpeTokenizer::load(path);
    if (loaded.decode(loaded.encode("round trip: \xc3\xa9t\xc3\xa9 2026\n")) != "round trip: \xc3\xa9t\xc3\xa9 2026\n")
      __builtin_trap();
  } catch (const dstrain::Error&) {
  }
  if (size <= 4096) {  // training is quadratic-ish: keep the fuzzer fast
    const BpeTokenizer bpe = BpeTokenizer::train(text, 256 + int64_t(size % 64));
    if (bpe.decode(bpe.encode(text)) != text) __builtin_trap();
  }
  if (ByteTokenizer().decode(ByteTokenizer().encode(text)) != text) __builtin_trap();
  try {
    dstrain::config::TrainConfig cfg =
        dstrain::config::load_config_text("model:\n  preset: tiny\nseq_length: 8\ntrain_batch_size: 1\n", "fuzz.yaml",
                                          {"data.path=" + path, "data.format=text"});
    TokenDataset ds(cfg);
    std::vector<int32_t> tokens(size_t(2 * (cfg.seq_length + 1)));
    ds.train_batch(tokens.data(), 0, 2);
  } catch (const dstrain::ConfigError&) {
  }
  unlink(path.c_str());
  return 0;
}
