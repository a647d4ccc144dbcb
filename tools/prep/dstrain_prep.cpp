// dstrain-prep: text files -> a tokenised dataset (format "dstrain-tokens" v1, see
// engine/data/token_dataset.h), with a byte-level tokenizer built in or a byte-level BPE that it
// trains (or loads) and saves next to the data.
//
//   dstrain-prep --input FILE [--input FILE ...] --output DATA.h5
//                [--tokenizer bytes|bpe|hf:PATH] [--vocab-size N] [--tokenizer-file PATH] [--force]
//                [--output-format dstrain|megatron] [--append-eod]
//
// --tokenizer hf:PATH applies a Hugging Face tokenizer.json (PATH: the file, or the directory
// holding it; engine/data/hf_tokenizer.h) as transformers' encode(text) does with its default
// add_special_tokens=True — per input file, a document: DeepSeek's BOS leads each — and copies
// it next to the data (DATA.tokenizer.json, and its tokenizer_config.json as
// DATA.tokenizer_config.json). --append-eod ends every document with the EOS token
// (tokenizer_config.json's eos_token), as Megatron's preprocess_data.py --append-eod does.
//
// --output-format megatron writes Megatron-LM's indexed dataset instead (DATA.bin + DATA.idx,
// --output naming the prefix; engine/data/indexed_dataset.h), one document per input file, which
// Megatron and dstrain (data.format: megatron) both train on.
// With --tokenizer bpe and no --tokenizer-file, a BPE of --vocab-size tokens is trained on the
// inputs and saved as DATA.tokenizer; with --tokenizer-file, that tokenizer is applied as is.
// Existing outputs are kept unless --force; a --vocab-size the inputs cannot reach (BPE stops
// when no pair of tokens repeats) is an error, not a smaller vocabulary.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "engine/common/host_memory.h"
#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/config/load_config.h"
#include "engine/data/hf_tokenizer.h"
#include "engine/data/indexed_dataset.h"
#include "engine/data/token_dataset.h"
#include "engine/data/tokenizer.h"

namespace {

struct Args {
  std::vector<std::string> inputs;
  std::string output, tokenizer = "bytes", tokenizer_file, output_format = "dstrain";
  int64_t vocab_size = 0;
  bool force = false, append_eod = false;
};

const char* kUsage =
    "usage: dstrain-prep --input FILE [--input FILE ...] --output DATA.h5\n"
    "                    [--tokenizer bytes|bpe|hf:PATH/tokenizer.json] [--vocab-size N] [--tokenizer-file PATH]\n"
    "                    [--force] [--output-format dstrain|megatron] [--append-eod]\n";

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (k == "--force") {
      a.force = true;
      continue;
    }
    if (k == "--append-eod") {
      a.append_eod = true;
      continue;
    }
    if (i + 1 >= argc) throw dstrain::ConfigError(fmt::format("{} needs a value\n{}", k, kUsage));
    const std::string v = argv[++i];
    if (k == "--input") a.inputs.push_back(v);
    else if (k == "--output") a.output = v;
    else if (k == "--tokenizer") a.tokenizer = v;
    else if (k == "--tokenizer-file") a.tokenizer_file = v;
    else if (k == "--output-format") a.output_format = v;
    else if (k == "--vocab-size") {
      char* end = nullptr;
      a.vocab_size = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || a.vocab_size < 1)
        throw dstrain::ConfigError(fmt::format("--vocab-size {}: valid: a positive integer", v));
    }
    else throw dstrain::ConfigError(fmt::format("unknown option '{}'\n{}", k, kUsage));
  }
  if (a.inputs.empty() || a.output.empty())
    throw dstrain::ConfigError(fmt::format("--input and --output are required\n{}", kUsage));
  if (a.output_format != "dstrain" && a.output_format != "megatron")
    throw dstrain::ConfigError(fmt::format("--output-format {}: valid: dstrain, megatron", a.output_format));
  if (a.tokenizer != "bytes" && a.tokenizer != "bpe" && a.tokenizer.rfind("hf:", 0) != 0)
    throw dstrain::ConfigError(fmt::format("--tokenizer {}: valid: bytes, bpe, hf:PATH (a Hugging Face tokenizer.json)",
                                           a.tokenizer));
  if (a.append_eod && a.tokenizer.rfind("hf:", 0) != 0)
    throw dstrain::ConfigError("--append-eod needs a tokenizer with an EOS token: --tokenizer hf:PATH");
  if (!a.tokenizer_file.empty() && a.tokenizer != "bpe")
    throw dstrain::ConfigError(fmt::format("--tokenizer-file {} is a BPE tokenizer, but the tokenizer is {}; valid: "
                                           "add --tokenizer bpe, or drop --tokenizer-file",
                                           a.tokenizer_file, a.tokenizer));
  if (a.tokenizer == "bpe" && a.tokenizer_file.empty() && a.vocab_size < 257)
    throw dstrain::ConfigError("--tokenizer bpe needs --vocab-size N (N > 256) or --tokenizer-file");
  return a;
}

std::string read_all(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw dstrain::ConfigError(fmt::format("--input {}: is a directory; valid: text files (one --input each)", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw dstrain::ConfigError(fmt::format("--input {}: cannot open the input file", path));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw dstrain::ConfigError(fmt::format("--input {}: cannot be read", path));
  return text;
}

// The outputs (the dataset, and the tokenizer saved next to it) must not be any of the files
// read: --force would replace the corpus or the tokenizer with what is made of it.
void refuse_overwriting_inputs(const Args& a, const std::vector<std::filesystem::path>& outputs) {
  std::vector<std::pair<std::string, std::string>> read;  // (option, path)
  for (const std::string& in : a.inputs) read.emplace_back("--input", in);
  if (!a.tokenizer_file.empty()) read.emplace_back("--tokenizer-file", a.tokenizer_file);
  for (const auto& out : outputs)
    for (const auto& [option, in] : read) {
      // (the tokenizer applied as is may be saved over itself: the same file again)
      if (option == "--tokenizer-file" && out != outputs.front()) continue;
      std::error_code ec;
      if (std::filesystem::exists(out, ec) && std::filesystem::equivalent(out, in, ec))
        throw dstrain::ConfigError(fmt::format("{} {} is also an output ({}): writing it would destroy it; valid: an "
                                               "--output elsewhere",
                                               option, in, out.string()));
    }
}

int run(const Args& a) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  std::string text;
  std::error_code ec;
  const bool megatron = a.output_format == "megatron";
  const std::string prefix = dstrain::config::megatron_prefix(a.output);  // (Megatron: the files' prefix)
  const std::filesystem::path out_path(megatron ? prefix + ".bin" : a.output);
  const std::filesystem::path tokenizer_path =
      out_path.parent_path() / ((megatron ? std::filesystem::path(prefix).filename().string() : out_path.stem().string()) +
                                ".tokenizer");
  std::vector<std::filesystem::path> outputs = {out_path};
  if (megatron) outputs.push_back(prefix + ".idx");
  const bool hf = a.tokenizer.rfind("hf:", 0) == 0;
  std::filesystem::path hf_json;  // the tokenizer.json applied, and its copy beside the data
  if (hf) {
    hf_json = a.tokenizer.substr(3);
    if (std::filesystem::is_directory(hf_json, ec)) hf_json /= "tokenizer.json";
    outputs.push_back(tokenizer_path.string() + ".json");
  }
  if (a.tokenizer == "bpe") outputs.push_back(tokenizer_path);
  refuse_overwriting_inputs(a, outputs);
  std::vector<std::string> documents;  // one per input file
  for (const std::string& in : a.inputs) documents.push_back(read_all(in)), text += documents.back();
  if (text.empty()) throw dstrain::ConfigError("the inputs are empty");
  for (const auto& p : outputs)
    if (!a.force && std::filesystem::exists(p, ec))
      throw dstrain::ConfigError(fmt::format("{} exists already; valid: another --output, or --force to replace it",
                                             p.string()));
  const auto parent = out_path.parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::vector<int32_t> tokens;
  int64_t vocab = 256;
  std::string tok_file;
  std::vector<std::vector<int32_t>> docs;  // (Megatron: each input file encoded on its own)
  std::string tok_name = a.tokenizer;
  if (hf) {
    const auto t = dstrain::data::HfTokenizer::load(hf_json.string());
    const std::optional<int32_t> eod = t->eos_id();
    if (a.append_eod && !eod)
      throw dstrain::ConfigError(fmt::format("--append-eod: {} names no EOS token (tokenizer_config.json's eos_token)",
                                             hf_json.string()));
    for (const std::string& d : documents) {
      docs.push_back(t->encode_with_special(d));
      if (a.append_eod) docs.back().push_back(*eod);
      tokens.insert(tokens.end(), docs.back().begin(), docs.back().end());
    }
    vocab = t->vocab_size();
    tok_name = "hf";
    const std::filesystem::path copy = tokenizer_path.string() + ".json";
    if (std::filesystem::weakly_canonical(copy, ec) != std::filesystem::weakly_canonical(hf_json, ec))
      std::filesystem::copy_file(hf_json, copy, std::filesystem::copy_options::overwrite_existing);
    tok_file = copy.filename().string();
    // Its tokenizer_config.json (BOS / EOS names and flags) goes along as NAME.tokenizer_config.json,
    // where HfTokenizer::load looks for it beside NAME.tokenizer.json.
    const std::filesystem::path config = hf_json.parent_path() / "tokenizer_config.json",
                                config_copy = tokenizer_path.string() + "_config.json";
    if (std::filesystem::exists(config, ec) &&
        std::filesystem::weakly_canonical(config_copy, ec) != std::filesystem::weakly_canonical(config, ec))
      std::filesystem::copy_file(config, config_copy, std::filesystem::copy_options::overwrite_existing);
  } else if (a.tokenizer == "bytes") {
    tokens = dstrain::data::ByteTokenizer().encode(text);
    if (megatron)
      for (const std::string& d : documents) docs.push_back(dstrain::data::ByteTokenizer().encode(d));
  } else {
    dstrain::data::BpeTokenizer bpe = a.tokenizer_file.empty()
                                          ? dstrain::data::BpeTokenizer::train(text, a.vocab_size)
                                          : dstrain::data::BpeTokenizer::load(a.tokenizer_file);
    if (a.tokenizer_file.empty() && bpe.vocab_size() < a.vocab_size)
      throw dstrain::ConfigError(fmt::format("--vocab-size {}: the inputs support only {} tokens (beyond that no pair "
                                             "of tokens occurs twice); valid: --vocab-size <= {}, or more text",
                                             a.vocab_size, bpe.vocab_size(), bpe.vocab_size()));
    const std::filesystem::path saved = tokenizer_path;
    bpe.save(saved.string());
    tok_file = saved.filename().string();
    tokens = bpe.encode(text);
    vocab = bpe.vocab_size();
    if (bpe.decode(tokens) != text) throw dstrain::Error("BPE round trip failed: decode(encode(text)) != text");
    if (megatron)
      for (const std::string& d : documents) docs.push_back(bpe.encode(d));
  }
  if (megatron) {  // one document per input file
    tokens.clear();
    for (const auto& d : docs) tokens.insert(tokens.end(), d.begin(), d.end());
    dstrain::data::write_megatron_dataset(prefix, docs, vocab);
  } else {
    dstrain::data::write_token_dataset(a.output, tokens, vocab, tok_name, tok_file, dstrain::join(a.inputs, "\n"));
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("%s: %s tokens from %s bytes (%.2f bytes/token), vocab %ld (%s%s), %.1f s\n",
              megatron ? (prefix + ".bin/.idx (Megatron)").c_str() : a.output.c_str(), dstrain::with_commas(int64_t(tokens.size())).c_str(),
              dstrain::with_commas(int64_t(text.size())).c_str(), double(text.size()) / double(tokens.size()),
              long(vocab), tok_name.c_str(), tok_file.empty() ? "" : (", " + tok_file).c_str(), secs);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  dstrain::tune_host_allocator();
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {  // every failure: one line, never an uncaught exception
    std::fprintf(stderr, "dstrain-prep: error: %s\n", e.what());
    return 1;
  }
}
