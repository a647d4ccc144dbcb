// A rank's parameters, gradients and buffers (docs/design.md §2.2, §7.1): one flat buffer for dense
// parameters and one for routed-expert parameters (so a gradient bucket or a ZeRO shard is a
// slice, and expert parameters can reduce over their own group), each with a twin gradient
// buffer, and named views built from the plan's parameter registry. Only this rank's stage and
// shards are held, at their local shapes.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/model/flat_array.h"
#include "engine/plan/param_table.h"

namespace dstrain::model {

// Where this rank sits: its pipeline stage and its tensor- and expert-parallel coordinates.
struct ShardCoords {
  int stage = 0;
  int tp = 0, tp_size = 1;
  int ep = 0, ep_size = 1;
};

using FlatBuffer = FlatArray<float>;

struct ParamView {
  const plan::ParamInfo* info = nullptr;
  plan::ShardSpec shard;  // offset and local shape within the full tensor
  bool expert = false;    // lives in the expert buffers
  bool buffer = false;    // lives in the buffer store (no gradient)
  int64_t offset = 0;     // into its flat buffer
  int64_t numel = 0;      // local
  // Elements reserved in the flat buffer: numel, except for a vocabulary shard, which reserves
  // a whole block of ceil(V / tp) rows. Every tensor-parallel rank's buffers then have the same
  // layout (the last ranks' unused rows stay zero: no kernel reads or writes them, and AdamW
  // skips them), so the data-parallel reductions and ZeRO partitions — and with them the
  // replicated parameters — come out bitwise the same on every tensor-parallel rank.
  int64_t stored = 0;
};

class ParamStore {
 public:
  // `be`: the backend whose ops use the buffers; when its memory is not host memory (a GPU) the
  // buffers are device memory from it (FlatArray), otherwise — and without a backend — host
  // shared memory.
  ParamStore(const std::vector<plan::ParamInfo>& table, const std::vector<int>& param_stage,
             int64_t num_experts, const ShardCoords& where, kernels::Backend* be = nullptr);

  bool has(const std::string& name) const { return views_.count(name) > 0; }
  const ParamView& view(const std::string& name) const;
  float* param(const std::string& name);
  float* grad(const std::string& name);
  const float* param(const std::string& name) const;
  const float* grad(const std::string& name) const;

  // Every held tensor in registry order (parameters and buffers).
  const std::vector<std::string>& names() const { return order_; }

  // Layout-invariant initialisation (docs/model.md §6): element i of parameter P is
  // initializer_range * normal(stream (seed, P), global index of i); norms 1, biases and
  // buffers 0; the embedding row `pad_token_id`, if given, 0. Only the local slice is generated.
  void initialize(uint64_t seed, double initializer_range,
                  std::optional<int64_t> pad_token_id = std::nullopt);

  void zero_grads();

  // In shared memory (engine/common/shared_memory.h) on the CPU: data-parallel peers on one host
  // reduce and gather these buffers by mapping them. In device memory on a GPU.
  FlatBuffer& dense_params() { return dense_; }
  FlatBuffer& expert_params() { return expert_; }
  FlatBuffer& dense_grads() { return dense_grad_; }
  FlatBuffer& expert_grads() { return expert_grad_; }
  FlatBuffer& buffers() { return buffers_; }
  const FlatBuffer& buffers() const { return buffers_; }
  // Whether the buffers are device memory (read them through FlatArray::read / local_values).
  bool on_device() const { return dense_.on_device(); }
  // Host copies of a tensor's local slice (its values, or its gradient).
  std::vector<float> local_values(const std::string& name, bool grad = false) const;
  void set_local_values(const std::string& name, const std::vector<float>& values, bool grad = false);

  // Mixed precision (docs/design.md §6.10): 16-bit compute copies of the two flat parameter
  // buffers, same layout — the only copy of the weights the model reads. The parameters whose
  // ops read fp32 values (reads_fp32: norm weights, biases, the router's weight — small tensors)
  // also have a side copy of their rounded values, widened: param(name) points there, and it is
  // null for every other parameter. The fp32 buffers hold the initial (or loaded) values only
  // until the optimizer takes its fp32 master weights from them (release_fp32); there is no
  // fp32 copy of the compute weights while training. Call after pad().
  void enable_compute_copy(kernels::DType dtype);
  kernels::DType compute_dtype() const { return compute_dtype_; }
  bool has_compute_copy() const { return compute_dtype_ != kernels::DType::kF32; }
  // Under mixed precision, whether the model's ops read this parameter in fp32 (above).
  static bool reads_fp32(const ParamView& v);
  // The parameter's compute copy; null without compute copies, for buffers and for the
  // parameters that are read in fp32.
  const uint16_t* compute_param(const std::string& name) const;
  // The compute copy of a parameter the model reads from it (the embedding lookup too).
  const uint16_t* compute_values(const std::string& name) const;
  FlatArray<uint16_t>& compute_copy(bool expert) { return expert ? lp_expert_ : lp_dense_; }
  // The fp32 parameter buffers: empty under mixed precision once released.
  FlatBuffer& params(bool expert) { return expert ? expert_ : dense_; }
  // Elements [begin, end) of a flat buffer: the fp32 values `src` (null: the fp32 buffer itself)
  // rounded into the compute copy, and the side copies of what overlaps the range widened.
  void round_to_compute(kernels::Backend& be, bool expert, int64_t begin, int64_t end, const float* src = nullptr);
  // Elements [begin, end): the side copies from the compute copy (after the copy was gathered).
  void widen_compute(kernels::Backend& be, bool expert, int64_t begin, int64_t end);
  // Frees the fp32 parameter buffers (mixed precision only; the optimizer keeps the master
  // weights). Afterwards local_values reads a parameter's compute copy, widened, and
  // set_local_values / load_full write the compute copy (rounded) and its side copy.
  void release_fp32();
  bool holds_fp32() const { return !has_compute_copy() || !fp32_released_; }
  // Bytes of the weights the model reads: fp32 buffers (while held), compute copies, side copies.
  int64_t weight_bytes() const;
  // Parameters held (without any padding).
  int64_t num_params() const { return num_params_; }
  // The flat buffers' lengths before ZeRO padding (the dense one includes the unused rows of a
  // vocabulary block, ParamView::stored).
  int64_t dense_numel() const { return dense_numel_; }
  int64_t expert_numel() const { return expert_numel_; }
  // Extends the flat parameter and gradient buffers with zeros to these lengths (ZeRO partitions
  // are equal-sized: at stage >= 1 the dense buffer is padded to its partition over the
  // data-parallel group, the expert buffer over the expert-data-parallel group;
  // parallel::ZeroSharding::buffer_length). Moves the buffers: call it before anything keeps
  // pointers into them.
  void pad(int64_t dense_len, int64_t expert_len);

  // Copies a rank's slice of a tensor, held in `local` (any flat buffer laid out like this
  // store's, e.g. optimizer moments: pass the address of the view's first element), into the
  // full tensor.
  static void slice_to_full(const ParamView& v, const float* local, float* full);

  // Copies between a full tensor and this rank's slice of it.
  void load_full(const std::string& name, const float* full, bool into_grad = false);
  void store_full(const std::string& name, float* full, bool from_grad = false) const;

 private:
  float* base(const ParamView& v, bool grad);
  const float* base(const ParamView& v, bool grad) const;
  FlatBuffer& buffer_of(const ParamView& v, bool grad);
  const FlatBuffer& buffer_of(const ParamView& v, bool grad) const;

  // Host values of a parameter's slice from / into its compute copy (mixed precision, released).
  std::vector<float> widened_values(const ParamView& v) const;
  void write_rounded(const ParamView& v, const float* host);

  kernels::Backend* be_ = nullptr;
  std::map<std::string, ParamView> views_;
  std::vector<std::string> order_;
  FlatBuffer dense_, expert_, dense_grad_, expert_grad_;
  kernels::DType compute_dtype_ = kernels::DType::kF32;
  FlatArray<uint16_t> lp_dense_, lp_expert_;
  bool fp32_released_ = false;
  // The side copies: for each parameter read in fp32, its offset in side_ (by name).
  std::map<std::string, int64_t> side_offset_;
  FlatBuffer side_;
  FlatBuffer buffers_;
  int64_t num_params_ = 0, dense_numel_ = 0, expert_numel_ = 0;
};

}  // namespace dstrain::model
