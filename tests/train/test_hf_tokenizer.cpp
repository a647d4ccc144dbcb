// Hugging Face tokenizer.json (engine/data/hf_tokenizer.h) against transformers: GPT-2's and
// DeepSeek-V3's tokenizers (tests/data/hf_tokenizer/, made by tools/make_tokenizer_golden.py)
// give transformers' ids for ~40 texts — prose, whitespace runs, numbers, code, CJK, scripts,
// emoji, the special tokens written in the text — with and without special tokens, and decode
// back to the text; any bytes round-trip; an unsupported tokenizer is refused in one line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "engine/common/error.h"
#include "engine/data/hf_tokenizer.h"

namespace dstrain::data {
namespace {
namespace fs = std::filesystem;

class HfTokenizerGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(HfTokenizerGolden, IdsEqualTransformersAndDecodeRoundTrips) {
  const std::string dir = "tests/data/hf_tokenizer/" + GetParam();
  const auto tok = HfTokenizer::load(dir + "/tokenizer.json");
  std::ifstream in(dir + "/golden.jsonl");
  ASSERT_TRUE(in) << dir;
  int cases = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json g = nlohmann::json::parse(line);
    const std::string text = g["text"];
    const std::vector<int32_t> want = g["ids"], want_special = g["ids_with_special"];
    EXPECT_EQ(tok->encode(text), want) << "text: " << nlohmann::json(text).dump();
    EXPECT_EQ(tok->encode_with_special(text), want_special) << "text: " << nlohmann::json(text).dump();
    EXPECT_EQ(tok->decode(tok->encode(text)), text);
    ++cases;
  }
  EXPECT_GE(cases, 30);
  // Any bytes, valid UTF-8 or not, round-trip.
  std::mt19937 rng(7);
  for (int t = 0; t < 200; ++t) {
    std::string s(size_t(rng() % 64), '\0');
    for (char& c : s) c = char(rng() % 256);
    EXPECT_EQ(tok->decode(tok->encode(s)), s);
  }
}

INSTANTIATE_TEST_SUITE_P(Transformers, HfTokenizerGolden, ::testing::Values("gpt2", "deepseek_v3"));

// tokenizer_config.json's add_bos_token / add_eos_token (DeepSeek's R1 and hub V3 configs set
// add_bos_token): BOS before and EOS after every encoding with special tokens, none without.
TEST(HfTokenizer, TokenizerConfigFlagsAddBosAndEos) {
  const std::string dir = ::testing::TempDir() + "/hf_tok_bos";
  fs::create_directories(dir);
  fs::copy_file("tests/data/hf_tokenizer/deepseek_v3/tokenizer.json", dir + "/tokenizer.json",
                fs::copy_options::overwrite_existing);
  nlohmann::json c = nlohmann::json::parse(std::ifstream("tests/data/hf_tokenizer/deepseek_v3/tokenizer_config.json"));
  c["add_bos_token"] = true;
  c["add_eos_token"] = true;
  std::ofstream(dir + "/tokenizer_config.json") << c.dump();
  const auto tok = HfTokenizer::load(dir + "/tokenizer.json");
  ASSERT_TRUE(tok->bos_id() && tok->eos_id());
  EXPECT_EQ(*tok->bos_id(), 0);
  EXPECT_EQ(*tok->eos_id(), 1);
  const std::vector<int32_t> plain = tok->encode("hello world");
  std::vector<int32_t> want = {0};
  want.insert(want.end(), plain.begin(), plain.end());
  want.push_back(1);
  EXPECT_EQ(tok->encode_with_special("hello world"), want);
  EXPECT_EQ(tok->encode_with_special(""), (std::vector<int32_t>{0, 1}));
}

// A copy of GPT-2's tokenizer.json with one part replaced must be refused naming that part.
void expect_refused(const std::string& name, const std::function<void(nlohmann::json&)>& edit, const std::string& what) {
  nlohmann::json j = nlohmann::json::parse(std::ifstream("tests/data/hf_tokenizer/gpt2/tokenizer.json"));
  edit(j);
  const std::string dir = ::testing::TempDir() + "/hf_tok_" + name;
  fs::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << j.dump();
  try {
    HfTokenizer::load(dir + "/tokenizer.json");
    ADD_FAILURE() << name << " loaded";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir + "/tokenizer.json"), std::string::npos) << e.what();
  }
}

TEST(HfTokenizer, UnsupportedTokenizersAreRefusedInOneLine) {
  expect_refused("wordpiece", [](auto& j) { j["model"]["type"] = "WordPiece"; }, "model type WordPiece");
  expect_refused("unigram", [](auto& j) { j["model"].erase("merges"); }, "model type (none)");
  expect_refused("nfc", [](auto& j) { j["normalizer"] = {{"type", "NFC"}}; }, "normalizer NFC");
  expect_refused("metaspace", [](auto& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }, "pre-tokenizer Metaspace");
  expect_refused("fallback", [](auto& j) { j["model"]["byte_fallback"] = true; }, "byte_fallback");
  expect_refused("no_byte", [](auto& j) { j["model"]["vocab"].erase("!"); }, "lacks byte 0x21");
  expect_refused("bad_regex", [](auto& j) {
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  }, "does not compile");
  EXPECT_THROW(HfTokenizer::load("tests/data/hf_tokenizer/none/tokenizer.json"), ConfigError);
  EXPECT_THROW(HfTokenizer::load("configs/tiny.yaml"), ConfigError);  // not JSON
}

// Split on digits with no merges (one token per byte): Removed drops the digits, inverted the
// letters; the behaviours that only regroup pieces keep every byte.
TEST(HfTokenizer, SplitRemovedDropsTheMatchesOrWithInvertTheRest) {
  const auto pieces = [](const std::string& behavior, bool invert) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream("tests/data/hf_tokenizer/gpt2/tokenizer.json"));
    j["pre_tokenizer"] = {{"type", "Sequence"},
                          {"pretokenizers",
                           {{{"type", "Split"}, {"pattern", {{"Regex", "[0-9]"}}}, {"behavior", behavior}, {"invert", invert}},
                            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
    j["model"]["merges"] = nlohmann::json::array();  // one token per byte: the pieces show as they are cut
    j["added_tokens"] = nlohmann::json::array();
    j["post_processor"] = nullptr;
    const std::string dir = ::testing::TempDir() + "/hf_tok_split";
    fs::create_directories(dir);
    std::ofstream(dir + "/tokenizer.json") << j.dump();
    return HfTokenizer::load(dir + "/tokenizer.json")->encode("ab12c3");
  };
  const std::vector<int32_t> all = pieces("Isolated", false);
  EXPECT_EQ(all.size(), 6u);
  EXPECT_EQ(pieces("Removed", false).size(), 3u);  // the digits go
  EXPECT_EQ(pieces("Removed", true).size(), 3u);   // the letters go
  EXPECT_EQ(pieces("MergedWithPrevious", false), all);
  EXPECT_EQ(pieces("Contiguous", false), all);
}

}  // namespace
}  // namespace dstrain::data
