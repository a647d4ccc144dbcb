#include "engine/runtime/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "engine/common/error.h"
#include "engine/common/strings.h"
#include "engine/config/load_config.h"
#include "engine/data/token_dataset.h"
#include "engine/data/hf_tokenizer.h"
#include "engine/data/tokenizer.h"
#include "engine/io/hdf5_file.h"
#include "engine/runtime/checkpoint.h"
#include "engine/runtime/rank_engine.h"

namespace dstrain::runtime {

int32_t pick_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double uniform) {
  if (vocab <= 0) throw Error("pick_token: an empty vocabulary");
  if (temperature <= 0 || top_k == 1)
    return int32_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  const int64_t k = top_k > 0 ? std::min(top_k, vocab) : vocab;
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  const double top = logits[ids[0]];
  std::vector<double> p(static_cast<size_t>(k));
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += p[size_t(i)] = std::exp((double(logits[ids[size_t(i)]]) - top) / temperature);
  double acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    acc += p[size_t(i)] / sum;
    if (uniform < acc) return ids[size_t(i)];
  }
  return ids[size_t(k - 1)];
}

Generated generate(const std::string& path, const GenerateOptions& o) {
  if (o.prompt.empty()) throw ConfigError("generate: --prompt is empty; give the text to continue");
  std::string checkpoint = path;
  if (std::filesystem::is_directory(path)) {  // a checkpoint directory: the one `latest` names
    // (a bare file name inside the directory, as the writer writes it: checkpoint.cpp read_latest)
    checkpoint = latest_checkpoint(path);
    if (checkpoint.empty())
      throw ConfigError(fmt::format("generate: {} is a directory without a `latest` file (no checkpoint saved there)",
                                    printable(path, 200)));
  }
  if (!std::filesystem::is_regular_file(checkpoint))
    throw ConfigError(fmt::format("generate: {} is not a checkpoint file (give a step_*.h5 of checkpoint.dir)",
                                  printable(checkpoint, 200)));
  std::string yaml;
  Generated out;
  out.checkpoint = checkpoint;
  {
    // Probed in a child and the root attributes' checksum checked before anything is read.
    const std::unique_ptr<io::H5File> f = open_checkpoint_file(checkpoint);
    yaml = f->attr_string("config_yaml");
    out.step = int64_t(f->attr_double("step"));
  }
  // The model as trained, on one process, fp32, one sequence at a time.
  // (Without its learning-rate schedule, which generation does not use.)
  config::TrainConfig cfg = config::load_config_text(yaml, checkpoint + " (its config)", {"scheduler=null"});
  config::ParallelConfig& p = cfg.parallel;
  p.tensor = p.pipeline = p.expert = p.virtual_stages = 1;
  p.data = config::AutoInt{1};
  p.sequence_parallel = false;
  p.stage_layers.clear();
  cfg.train_batch_size = 1;
  cfg.train_micro_batch_size_per_gpu = config::AutoInt{1};
  cfg.gradient_accumulation_steps = 1;
  cfg.memory_budget_gib.reset();
  cfg.bf16.enabled = cfg.fp16.enabled = false;
  cfg.activation_checkpointing.enabled = false;
  cfg.zero_optimization.stage = 0;
  config::validate(cfg);
  const data::TokenDataset dataset(cfg);
  const data::DatasetInfo& d = dataset.info();
  std::unique_ptr<data::Tokenizer> tok;
  if (d.tokenizer == "bpe")
    tok = std::make_unique<data::BpeTokenizer>(data::BpeTokenizer::load(
        (std::filesystem::path(d.path).parent_path() / d.tokenizer_file).string()));
  else if (d.tokenizer == "hf")
    tok = data::HfTokenizer::load((std::filesystem::path(d.path).parent_path() / d.tokenizer_file).string());
  else
    tok = std::make_unique<data::ByteTokenizer>();
  out.tokenizer = tok->name();
  // (a Hugging Face tokenizer's prompt as its documents were prepared: with its BOS / EOS rules)
  const auto* hf = dynamic_cast<const data::HfTokenizer*>(tok.get());
  out.prompt_ids = hf ? hf->encode_with_special(o.prompt) : tok->encode(o.prompt);
  if (out.prompt_ids.empty()) throw ConfigError("generate: the prompt encodes to no tokens");

  const plan::ParallelPlan plan = plan::make_plan(cfg, 1);
  const RankGroups groups(plan);
  RankEngine e = build_rank_engine(plan, groups, EngineOptions{o.threads, /*gradients=*/false});
  Checkpointer(plan, groups.world()).load(checkpoint, *e.params, nullptr);
  model::DeepSeekModel& net = *e.model;
  net.keep_logits(true);

  const int64_t S = cfg.seq_length, V = cfg.model.vocab_size;
  const int64_t vocab = std::min<int64_t>(V, tok->vocab_size());
  std::mt19937_64 rng(o.seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<int32_t> context = out.prompt_ids, tokens(size_t(S + 1), 0);
  const model::LossScale scale{double(S), 1.0, 1.0, false};  // the logits only: no gradient work
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < o.max_new_tokens; ++i) {
    const int64_t n = std::min<int64_t>(int64_t(context.size()), S);  // the window: the last S tokens
    std::fill(tokens.begin(), tokens.end(), 0);
    std::copy(context.end() - n, context.end(), tokens.begin());
    net.forward_stage(tokens.data(), nullptr, scale);  // (causal: the padding after n does not matter)
    const int32_t next = pick_token(net.logits().data() + (n - 1) * V, vocab, o.temperature, o.top_k, uniform(rng));
    out.new_ids.push_back(next);
    context.push_back(next);
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.text = tok->decode(out.new_ids);
  return out;
}

}  // namespace dstrain::runtime
