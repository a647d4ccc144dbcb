// `dstrain generate CKPT --prompt TEXT` (docs/design.md §2.10): text from a checkpoint, so a user
// can see what the model learnt. The checkpoint's own config gives the model and the data; the
// data's tokenizer (bytes, or the BPE file beside a prepared dataset) encodes the prompt and
// decodes the reply. One process on one device, fp32, any layout the checkpoint was saved from.
// Each new token runs the model over the whole context window (the last seq_length tokens; no
// KV cache): the next token's logits are the main head's at the last prompt position. Greedy
// (temperature 0 or --greedy), or sampled from softmax(logits / temperature) over the top_k
// most likely tokens (0: all), seeded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain::runtime {

struct GenerateOptions {
  std::string prompt;
  int64_t max_new_tokens = 200;
  double temperature = 0.8;  // 0: greedy
  int64_t top_k = 40;        // 0: every token
  uint64_t seed = 1;
  int threads = 0;
};

struct Generated {
  std::string tokenizer;              // "bytes" or "bpe"
  std::vector<int32_t> prompt_ids, new_ids;
  std::string text;                   // the decoded new tokens
  int64_t step = 0;                   // the checkpoint's
  std::string checkpoint;             // the file read
  double seconds = 0;
};

// `checkpoint`: a checkpoint file, or a checkpoint directory (the one its `latest` names).
// Throws dstrain::Error (ConfigError naming the file) for a missing or unreadable checkpoint,
// an empty prompt, or a prompt the tokenizer cannot encode.
Generated generate(const std::string& checkpoint, const GenerateOptions& options);

// The next token from `logits` [vocab] (only ids < vocab are drawn): greedy or sampled, as above.
// `uniform`: a draw from [0, 1).
int32_t pick_token(const float* logits, int64_t vocab, double temperature, int64_t top_k, double uniform);

}  // namespace dstrain::runtime
