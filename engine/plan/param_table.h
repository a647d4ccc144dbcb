// The parameter registry (docs/design.md §2.2): every parameter and buffer of the model, declared once
// with its Hugging Face name, full unsharded shape in HF layout ([out, in] for a Linear), the
// place it lives in (which decides its pipeline stage), its shard rule (docs/model.md §10) and whether
// it gets weight decay. Gradient reduction, ZeRO, initialisation, checkpoints and export all
// iterate this table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config/train_config.h"

namespace dstrain::plan {

enum class Shard {
  kReplicated,  // full copy on every TP rank
  kColumn,      // dim 0 split over TP (column-parallel Linear: output features / heads)
  kRow,         // dim 1 split over TP (row-parallel Linear: input features)
  kVocab,       // dim 0 split over TP as contiguous vocabulary ranges
  kExpert,      // a routed expert: whole on the EP rank that owns it, absent elsewhere
};
const char* shard_name(Shard s);

struct ParamInfo {
  std::string name;            // HF name, e.g. model.layers.3.self_attn.kv_b_proj.weight
  std::vector<int64_t> shape;  // full shape, HF layout
  int64_t layer = 0;           // -1: embedding; 0..L-1: decoder layer; L..L+D-1: MTP; L+D: head
  Shard shard = Shard::kReplicated;
  int64_t expert = -1;         // routed expert index for kExpert
  bool weight_decay = false;   // matrices decay; norms, biases and buffers do not
  bool buffer = false;         // e_score_correction_bias: state, not a trained parameter

  int64_t numel() const;
};

// Under mixed precision, whether the model's ops read the parameter in fp32 (docs/design.md
// §6.10): norm weights and biases (1-D) and the router's weight (its logits stay fp32, as in
// Hugging Face) — small tensors, kept as a widened side copy of their rounded values; every other
// parameter is read from its 16-bit compute copy only (the GEMMs, the embedding lookup).
bool read_in_fp32(const ParamInfo& p);

// Builds the table for a model in HF state-dict order (embedding, layers, MTP, norm, head).
std::vector<ParamInfo> build_param_table(const config::ModelConfig& m);

// Layer index of the final norm and lm_head in ParamInfo::layer.
int64_t head_layer_index(const config::ModelConfig& m);

// The slice of a parameter held by the rank at tensor-parallel coordinate `tp` (of `tp_size`)
// and expert-parallel coordinate `ep` (of `ep_size`): offset and extent per dim of the full
// tensor. `held` is false when the rank holds none of it (another EP rank's expert).
struct ShardSpec {
  bool held = true;
  std::vector<int64_t> offset;
  std::vector<int64_t> local_shape;
  int64_t local_numel() const;
};
ShardSpec shard_of(const ParamInfo& p, int64_t num_experts, int tp, int tp_size, int ep, int ep_size);

// Vocabulary rows per tensor-parallel rank: ceil(V / tp). Rank r holds rows
// [r * block, min(V, (r + 1) * block)) of the embedding and lm_head (docs/model.md §10.1).
int64_t vocab_block(int64_t vocab_size, int tp_size);

}  // namespace dstrain::plan
