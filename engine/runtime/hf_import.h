// Importing a Hugging Face checkpoint (docs/checkpoint-format.md, "Importing from Hugging
// Face"): config.json + safetensors (one model.safetensors, or the shards a
// model.safetensors.index.json maps) of a DeepseekV2ForCausalLM / DeepseekV3ForCausalLM, written
// as a weights-only dstrain checkpoint that any layout starts from (checkpoint.resume: PATH).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/train_config.h"

namespace dstrain::runtime {

struct HfImport {
  config::ModelConfig model;              // the model config.json describes (as imported)
  int64_t tensors = 0;
  double bytes = 0;                       // fp32 bytes written
  std::vector<std::string> ignored_keys;  // config.json keys dstrain's model does not have
  std::vector<std::string> dtypes;        // the tensors' dtypes in the files, each once
  bool mtp_dropped = false;  // config.json names MTP layers the files do not hold (transformers drops them)
};

// Reads `hf_dir` and writes the checkpoint `out` (through out.tmp, renamed when complete; an
// existing `out` is refused). One tensor in memory at a time. Throws ConfigError naming the file
// and the tensor for: a missing config.json or model.safetensors(.index.json), a shard the
// index names that is missing, a truncated or malformed file, a tensor the model needs that no
// file holds, one whose shape differs from config.json's model, one no DeepSeek model has, a
// dtype other than F32 / BF16 / F16, and a NaN or Inf value.
HfImport import_hf_checkpoint(const std::string& hf_dir, const std::string& out);

}  // namespace dstrain::runtime
