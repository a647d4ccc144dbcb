// Tokenizers and datasets: BPE training and exact round trips, the file formats, and bad data
// files that must fail with a clear message naming the file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/data/token_dataset.h"
#include "engine/data/tokenizer.h"
#include "engine/io/hdf5_file.h"
#include "tests/unit/test_helpers.h"

namespace dstrain::data {
namespace {

std::string corpus() {
  std::ifstream in("data/tinyshakespeare.txt");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string tmp(const std::string& name) { return ::testing::TempDir() + "/" + name; }

TEST(Tokenizer, PretokenizationIsLossless) {
  const std::string text = "Hello,  world!\n\n  It's 2026: 3.14 \xc3\xa9t\xc3\xa9\tend ";
  std::string joined;
  for (auto c : pretokenize(text)) joined += c;
  EXPECT_EQ(joined, text);
  const auto chunks = pretokenize("the cat  sat");
  EXPECT_EQ(std::vector<std::string>(chunks.begin(), chunks.end()),
            (std::vector<std::string>{"the", " cat", " ", " sat"}));
}

TEST(Tokenizer, BpeLearnsTheMostFrequentPairsFirst) {
  // "aa" is the most frequent pair of "aaab aaab aaab" chunks, then "aa"+"a".
  const BpeTokenizer bpe = BpeTokenizer::train("aaab aaab aaab", 258);
  ASSERT_EQ(bpe.merges().size(), 2u);
  EXPECT_EQ(bpe.merges()[0], (std::pair<int32_t, int32_t>{'a', 'a'}));
  EXPECT_EQ(bpe.vocab_size(), 258);
}

TEST(Tokenizer, BpeRoundTripsAndCompressesShakespeare) {
  const std::string text = corpus().substr(0, 200000);
  const BpeTokenizer bpe = BpeTokenizer::train(text, 512);
  EXPECT_EQ(bpe.vocab_size(), 512);
  const auto ids = bpe.encode(text);
  EXPECT_EQ(bpe.decode(ids), text);
  EXPECT_LT(double(ids.size()), 0.6 * double(text.size()));
  for (int32_t id : ids) ASSERT_LT(id, 512);
  const std::string unseen = "Zebras \xe2\x9c\x93 quixotically juxtapose 12345!";
  EXPECT_EQ(bpe.decode(bpe.encode(unseen)), unseen);
  // Deterministic, and the file round-trips.
  EXPECT_EQ(BpeTokenizer::train(text, 512).merges(), bpe.merges());
  bpe.save(tmp("t.tokenizer"));
  EXPECT_EQ(BpeTokenizer::load(tmp("t.tokenizer")).merges(), bpe.merges());
}

TEST(Tokenizer, BadTokenizerFiles) {
  std::ofstream(tmp("bad1.tokenizer")) << "not a tokenizer\n";
  std::ofstream(tmp("bad2.tokenizer")) << "dstrain-bpe 1\nvocab_size 300\nmerges 44\n97 97\n";
  std::ofstream(tmp("bad3.tokenizer")) << "dstrain-bpe 7\nvocab_size 256\nmerges 0\n";
  const std::pair<const char*, const char*> cases[] = {
      {"bad1.tokenizer", "not a dstrain BPE tokenizer"},
      {"bad2.tokenizer", "merge 1 is missing or refers to an unknown token"},
      {"bad3.tokenizer", "format version 7"},
      {"missing.tokenizer", "cannot open the tokenizer file"}};
  for (const auto& [file, fragment] : cases) {
    try {
      BpeTokenizer::load(tmp(file));
      ADD_FAILURE() << file << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(file), std::string::npos) << e.what();
    }
  }
}

config::TrainConfig with_data(const std::string& path, const std::string& format,
                              const std::vector<std::string>& more = {}) {
  std::vector<std::string> sets = {"data.path=" + path, "data.format=" + format};
  sets.insert(sets.end(), more.begin(), more.end());
  return config::load_config_file("configs/tiny.yaml", sets);
}

TEST(Dataset, PreparedDatasetLoadsWithItsVocabulary) {
  const std::string text = corpus().substr(0, 100000);
  const BpeTokenizer bpe = BpeTokenizer::train(text, 300);
  write_token_dataset(tmp("ok.h5"), bpe.encode(text), 300, "bpe", "ok.tokenizer", "test");
  const TokenDataset ds(with_data(tmp("ok.h5"), "tokens", {"model.vocab_size=300"}));
  EXPECT_EQ(ds.info().tokenizer, "bpe");
  EXPECT_EQ(ds.info().vocab_size, 300);
  EXPECT_GT(ds.info().train_samples, 100);
  std::vector<int32_t> batch(2 * 65);
  ds.train_batch(batch.data(), 0, 2);
  for (int32_t t : batch) EXPECT_LT(t, 300);
}

// Each bad file fails with one message that names the file and the problem.
TEST(Dataset, BadDataFiles) {
  std::ofstream(tmp("tiny.txt")) << "only a few bytes";
  std::ofstream(tmp("empty.txt"));
  std::ofstream(tmp("text_as_tokens.h5")) << "this is not HDF5";
  { io::H5File f(tmp("no_format.h5"), io::H5File::Mode::kCreate); const int32_t x[3] = {1, 2, 3}; f.write("tokens", x, {3}); }
  write_token_dataset(tmp("big_vocab.h5"), std::vector<int32_t>(5000, 700), 1000, "bpe", "x.tokenizer", "t");
  write_token_dataset(tmp("good.h5"), std::vector<int32_t>(200000, 7), 256, "bytes", "", "t");
  {  // a truncated copy of a valid dataset
    std::ifstream in(tmp("good.h5"), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(tmp("truncated.h5"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  struct Case { std::string file, format, fragment; std::vector<std::string> sets; };
  const Case cases[] = {
      {"does_not_exist.txt", "text", "is not a readable file", {}},
      {"empty.txt", "text", "is empty", {}},
      {"tiny.txt", "text", "make no sample of seq_length + 1 = 65 tokens", {}},
      {"text_as_tokens.h5", "tokens", "is not an HDF5 file", {}},
      {"no_format.h5", "tokens", "not a dstrain token dataset", {}},
      {"big_vocab.h5", "tokens", "more than the model's vocab_size 256", {}},
      {"truncated.h5", "tokens", "truncated.h5", {}},
      {"good.h5", "tokens", "validation split", {"data.validation_fraction=0.0001"}},
      {"tiny.txt", "text", "the text holds byte 121, but model.vocab_size is 100", {"model.vocab_size=100",
                                                                                     "seq_length=4"}},
  };
  for (const Case& c : cases) {
    try {
      const TokenDataset ds(with_data(tmp(c.file), c.format, c.sets));
      ADD_FAILURE() << c.file << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(c.fragment), std::string::npos) << c.file << ": " << msg;
      EXPECT_NE(msg.find(c.file), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace dstrain::data
