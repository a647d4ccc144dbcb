// Tokenizers and datasets: BPE training and exact round trips, the file formats, and bad data
// files that must fail with a clear message naming the file.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "engine/data/indexed_dataset.h"
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

// Megatron-LM's indexed format, as Megatron-Core's own writer made it (tools/make_megatron_golden.py):
// every integer element type, data.path as the prefix or either file, data.format auto or
// megatron; every window of every sample holds the ids the reference holds.
std::vector<int32_t> megatron_expected() {
  std::ifstream in("tests/data/megatron/expected_ids.txt");
  std::vector<int32_t> ids;
  for (int32_t v; in >> v;) ids.push_back(v);
  return ids;
}

TEST(Dataset, ReadsMegatronsIndexedFormatOfEveryIntegerType) {
  const std::vector<int32_t> want = megatron_expected();
  ASSERT_EQ(want.size(), 3003u);
  const std::string dir = "tests/data/megatron/";
  for (const char* type : {"uint16", "int32", "uint8", "int8", "int16", "int64"}) {
    const std::string prefix = dir + "shakespeare_" + type;
    for (const std::string& path : {prefix, prefix + ".idx", prefix + ".bin"}) {
      const config::TrainConfig cfg =
          config::load_config_file("configs/tiny.yaml", {"data.path=" + path, "seq_length=64",
                                                         "data.validation_fraction=0.1"});
      EXPECT_EQ(cfg.data.format, config::DataFormat::kMegatron) << path;
      const TokenDataset ds(cfg);
      EXPECT_EQ(ds.info().tokens, 3003) << path;
      EXPECT_EQ(ds.info().documents, 3) << path;  // the index's boundaries: sequences 0, 1, 3, 4
      EXPECT_EQ(ds.info().tokenizer, "megatron");
      const int64_t n = ds.info().train_samples, S = 64;
      std::vector<int32_t> w(S + 1);
      std::vector<bool> seen(size_t(n), false);
      for (int64_t g = 0; g < n; ++g) {
        const int64_t sample = ds.train_sample_at(g);
        ds.train_batch(w.data(), g, 1);
        ASSERT_TRUE(std::equal(w.begin(), w.end(), want.begin() + sample * S)) << path << " sample " << sample;
        seen[size_t(sample)] = true;
      }
      EXPECT_EQ(std::count(seen.begin(), seen.end(), true), n) << path;  // an epoch visits every sample once
      ds.validation_batch(w.data(), 0, 1);  // the validation split starts where training ends
      const int64_t val_start = 3003 - int64_t(3003 * 0.1);
      EXPECT_TRUE(std::equal(w.begin(), w.end(), want.begin() + val_start)) << path;
    }
  }
  const TokenDataset forced(config::load_config_file(
      "configs/tiny.yaml", {"data.path=" + dir + "shakespeare_uint16", "data.format=megatron", "seq_length=64"}));
  EXPECT_EQ(forced.info().tokens, 3003);
}

// dstrain-prep's Megatron writer gives the bytes Megatron-Core's writer gives for the same
// documents (one sequence each, uint16 below 65,500 tokens).
TEST(Dataset, WritesMegatronsIndexedFormatAsMegatronDoes) {
  const std::vector<int32_t> ids = megatron_expected();
  std::vector<std::vector<int32_t>> docs;
  for (auto [a, b] : {std::pair<int, int>{0, 1001}, {1001, 2202}, {2202, 3003}})
    docs.emplace_back(ids.begin() + a, ids.begin() + b);
  write_megatron_dataset(tmp("ours"), docs, 256);
  for (const char* ext : {".idx", ".bin"}) {
    std::ifstream a(tmp("ours") + ext, std::ios::binary), b(std::string("tests/data/megatron/documents_uint16") + ext,
                                                           std::ios::binary);
    const std::string x((std::istreambuf_iterator<char>(a)), {}), y((std::istreambuf_iterator<char>(b)), {});
    EXPECT_FALSE(y.empty()) << ext;
    EXPECT_EQ(x, y) << ext;
  }
  const MegatronIndex idx = read_megatron_index(tmp("ours"));
  EXPECT_EQ(idx.tokens, 3003);
  EXPECT_EQ(idx.documents, 4);
  EXPECT_EQ(idx.itemsize, 2);
  write_megatron_dataset(tmp("wide"), docs, 100000);  // int32 elements from 65,500 tokens
  EXPECT_EQ(read_megatron_index(tmp("wide")).itemsize, 4);
}

// A damaged or foreign Megatron dataset is refused with one line naming the file and the fault.
TEST(Dataset, BadMegatronFiles) {
  const std::string src = "tests/data/megatron/shakespeare_uint16";
  const auto bytes = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  const std::string idx = bytes(src + ".idx"), bin = bytes(src + ".bin");
  const auto make = [&](const std::string& name, std::string i, std::string b) {
    std::ofstream(tmp(name + ".idx"), std::ios::binary) << i;
    std::ofstream(tmp(name + ".bin"), std::ios::binary) << b;
    return tmp(name);
  };
  std::string floats = idx;
  floats[17] = 6;  // float64 elements
  std::string gap = idx;
  gap[9 + 8 + 1 + 8 + 8 + 4 * 4 + 8] += 2;  // the second sequence's pointer, two bytes late
  std::string big = bin;
  big[2 * 100] = char(0xff), big[2 * 100 + 1] = char(0x7f);  // token 32767 at position 100
  struct Case { std::string path, fragment; };
  const Case cases[] = {
      {make("magic", "MMIDIDY" + idx.substr(7), bin), "not a Megatron indexed dataset"},
      {make("floats", floats, bin), "float64"},
      {make("short_idx", idx.substr(0, 60), bin), "truncated Megatron index"},
      {make("short_bin", idx, bin.substr(0, 5000)), "truncated, or another dataset's"},
      {make("gap", gap, bin), "contiguous"},
      {make("trailing", idx + "xyz", bin), "unexpected bytes"},
  };
  for (const Case& c : cases) {
    try {
      read_megatron_index(c.path);
      ADD_FAILURE() << c.path << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(c.fragment), std::string::npos) << c.path << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(c.path), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  }
  // A token beyond the model's vocabulary: refused when its window is read, naming the position.
  const TokenDataset ds(config::load_config_file(
      "configs/tiny.yaml", {"data.path=" + make("big_token", idx, big), "seq_length=64", "data.validation_fraction=0"}));
  std::vector<int32_t> w(65);
  bool refused = false;
  for (int64_t g = 0; g < ds.info().train_samples && !refused; ++g) {
    try {
      ds.train_batch(w.data(), g, 1);
    } catch (const ConfigError& e) {
      refused = true;
      EXPECT_NE(std::string(e.what()).find("token 32767 at position 100"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(refused);
  // Only one of the two files: named at the config key.
  std::filesystem::remove(tmp("gap.bin"));
  try {
    config::load_config_file("configs/tiny.yaml", {"data.path=" + tmp("gap")});
    ADD_FAILURE() << "a prefix without its .bin was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("gap.bin' is not a readable file"), std::string::npos) << e.what();
  }
}

// A blend (data.paths, Megatron's --data-path semantics): positions go to the datasets by
// Megatron's rule — weight x max(i, 1) - count, largest first — each dataset walks its own
// seeded epochs, the answer does not depend on the order positions are asked for, validation
// draws on every dataset's own split, and the counts are logged per dataset (blend()).
TEST(Dataset, BlendFollowsMegatronsRuleAndEachDatasetsOrder) {
  std::vector<int32_t> a(20000), b(5000);  // token = position (+ 30000 in b): a window names its sample
  for (size_t i = 0; i < a.size(); ++i) a[i] = int32_t(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = int32_t(30000 + i);
  write_token_dataset(tmp("blend_a.h5"), a, 50000, "bpe", "x.tokenizer", "a");
  write_token_dataset(tmp("blend_b.h5"), b, 50000, "bpe", "x.tokenizer", "b");
  const config::TrainConfig cfg = config::load_config_file(
      "configs/tiny.yaml", {"data.paths=[0.7, " + tmp("blend_a.h5") + ", 0.3, " + tmp("blend_b.h5") + "]",
                            "model.vocab_size=50000", "seq_length=64"});
  const TokenDataset ds(cfg);
  const auto shares = ds.blend();
  ASSERT_EQ(shares.size(), 2u);
  EXPECT_DOUBLE_EQ(shares[0].weight, 0.7);
  EXPECT_EQ(ds.info().train_samples, shares[0].info.train_samples + shares[1].info.train_samples);
  // Megatron's rule, written out again here.
  const int64_t N = 3000;
  std::vector<int> want(N);
  int64_t count[2] = {0, 0};
  for (int64_t i = 0; i < N; ++i) {
    const double at = std::max<double>(double(i), 1.0);
    const int d = 0.3 * at - double(count[1]) > 0.7 * at - double(count[0]) ? 1 : 0;
    want[size_t(i)] = d, ++count[d];
  }
  std::vector<int32_t> w(65);
  const int64_t nb = shares[1].info.train_samples;
  std::vector<int> b_seen(size_t(nb), 0);
  int64_t b_picks = 0;
  for (int64_t g = 0; g < N; ++g) {
    const auto [d, sample] = ds.train_sample(g);
    ASSERT_EQ(d, want[size_t(g)]) << "position " << g;
    ds.train_batch(w.data(), g, 1);
    EXPECT_EQ(w[0], (d == 0 ? 0 : 30000) + int32_t(sample * 64)) << "position " << g;
    if (d == 1 && b_picks++ < nb) ++b_seen[size_t(sample)];
  }
  ASSERT_GE(b_picks, nb);  // b's first epoch is in the first 3,000 positions: every sample once
  EXPECT_EQ(std::count(b_seen.begin(), b_seen.end(), 1), nb);
  // Asked out of order (a resume, another rank's slice): the same answers.
  for (int64_t g : {int64_t(2999), int64_t(5), int64_t(1234), int64_t(0), int64_t(2000)})
    EXPECT_EQ(ds.train_sample(g).first, want[size_t(g)]) << g;
  // Validation: both datasets' own held-out tails.
  bool from[2] = {false, false};
  for (int64_t v = 0; v < 10; ++v) {
    ds.validation_batch(w.data(), v, 1);
    const bool in_b = w[0] >= 30000;
    from[in_b] = true;
    EXPECT_GE(in_b ? w[0] - 30000 : w[0], int32_t(in_b ? 5000 * 0.95 : 20000 * 0.95) - 1);
  }
  EXPECT_TRUE(from[0] && from[1]);
  // One dataset alone keeps the single-dataset order.
  const TokenDataset one(config::load_config_file(
      "configs/tiny.yaml", {"data.path=" + tmp("blend_a.h5"), "model.vocab_size=50000", "seq_length=64"}));
  const TokenDataset one_blend(config::load_config_file(
      "configs/tiny.yaml", {"data.paths=[1, " + tmp("blend_a.h5") + "]", "model.vocab_size=50000", "seq_length=64"}));
  for (int64_t g = 0; g < 500; ++g) EXPECT_EQ(one.train_sample_at(g), one_blend.train_sample_at(g));
  // Bad blends: named at the key.
  write_token_dataset(tmp("blend_c.h5"), std::vector<int32_t>(5000, 7), 256, "bytes", "", "c");
  const std::pair<std::string, std::string> bad[] = {
      {"[0.7, " + tmp("blend_a.h5") + ", 0.3]", "pairs of a weight and a path"},
      {"[" + tmp("blend_a.h5") + ", " + tmp("blend_b.h5") + "]", "where a weight belongs"},
      {"[-1, " + tmp("blend_a.h5") + ", 2, " + tmp("blend_b.h5") + "]", "where a weight belongs"},
      {"[0.5, " + tmp("blend_a.h5") + ", 0.5, " + tmp("missing.h5") + "]", "missing.h5' is not a readable file"},
      {"[0.5, " + tmp("blend_a.h5") + ", 0.5, " + tmp("blend_c.h5") + "]", "a blend needs one tokenization"},
  };
  for (const auto& [paths, fragment] : bad) {
    try {
      const TokenDataset d(config::load_config_file("configs/tiny.yaml",
                                                    {"data.paths=" + paths, "model.vocab_size=50000", "seq_length=64"}));
      ADD_FAILURE() << paths << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << paths << ": " << e.what();
    }
  }
}

// The epoch order is a permutation of the samples, computed per position: every n, small or
// past 2^32, maps [0, n) onto itself, and the seed and the epoch change it.
TEST(Dataset, SampleOrderIsAPermutationHeldInNoTable) {
  for (int64_t n : {1, 2, 3, 7, 64, 100, 1000, 4097}) {
    std::vector<int64_t> seen(size_t(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = permuted_index(42, n, i);
      ASSERT_TRUE(p >= 0 && p < n) << n;
      ++seen[size_t(p)];
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n) << n;
  }
  int moved = 0;
  for (int64_t i = 0; i < 1000; ++i) moved += permuted_index(42, 1000, i) != permuted_index(43, 1000, i);
  EXPECT_GT(moved, 900);
  const int64_t huge = (int64_t(1) << 33) + 12345;  // 8.6e9 samples: no table could hold them
  for (int64_t i : {int64_t(0), int64_t(1), huge / 2, huge - 1}) {
    const int64_t p = permuted_index(7, huge, i);
    EXPECT_TRUE(p >= 0 && p < huge);
  }
}

}  // namespace
}  // namespace dstrain::data
