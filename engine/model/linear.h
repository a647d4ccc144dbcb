// A linear layer y = x W^T (W [out, in], Hugging Face layout) over this rank's part of W, and
// the GEMM inputs it reads (docs/design.md §6.2, "Linear").
#pragma once

#include <initializer_list>
#include <string>

#include "engine/model/layer_env.h"

namespace dstrain::model {

// A GEMM input as a Linear reads it: fp32 values — rounded into a ComputeCast workspace by each
// GEMM that takes 16-bit operands — and/or the same values already in the compute type: an input
// several GEMMs read, rounded once (Linear::pin); a saved activation kept in 16 bits
// (GemmInput::saved); a gradient its producer wrote in 16 bits (Linear::dy_in_16bit). A 16-bit
// input without fp32 values feeds 16-bit GEMMs only.
struct GemmInput {
  const float* f32 = nullptr;
  kernels::ConstView lp;  // data null: no 16-bit values

  GemmInput() = default;
  GemmInput(const float* x) : f32(x) {}  // NOLINT(google-explicit-constructor): fp32 is the plain case
  GemmInput(const float* x, kernels::ConstView rounded) : f32(x), lp(rounded) {}
  // A saved activation as it is kept: fp32, or the compute type under bf16 / fp16.
  static GemmInput saved(const ActBuf& b) {
    if (b.dtype() == kernels::DType::kF32) return b.data();
    return rounded({b.raw(), b.dtype()});
  }
  // Values that exist in 16 bits only.
  static GemmInput rounded(kernels::ConstView v) { return {nullptr, v}; }
};

// One linear layer's weight and the choice of its GEMMs' operand type, in one place. It holds,
// read from the ParamStore by name: the weight's fp32 view (in fp32 training; absent under bf16 /
// fp16, where no fp32 copy of a GEMM weight exists), its gradient, its 16-bit compute copy, this
// rank's shape and the tensor-parallel split the plan gives it (plan::Shard: kColumn — output
// features split, the input replicated, the input gradient a partial sum over the ranks; kRow —
// input features split, the output a partial sum; kReplicated; kVocab; kExpert). Every GEMM it
// runs takes 16-bit operands — its compute copy and its input rounded to the compute type —
// when the weight has a compute copy and the model computes in bf16 / fp16 (low_precision()),
// and fp32 operands otherwise (fp32 training; the router, read in fp32 as Hugging Face does).
// The cross-rank sums a split calls for stay with the block that owns the layer (the decoder
// layer's reductions, MLA's batched all-reduce of its latents' gradients): a Linear never
// communicates.
class Linear {
 public:
  Linear() = default;
  // `name` as this rank holds it; `fused`: parameters stored right after it in the flat buffers,
  // with its input width, multiplied as one weight (gate_proj then up_proj).
  Linear(ParamStore& p, const std::string& name, std::initializer_list<std::string> fused = {});

  // Output rows [first, first + count) as a layer of their own (kv_a_proj_with_mqa's latent and
  // rope-key parts).
  Linear rows(int64_t first, int64_t count) const;

  int64_t out() const { return out_; }
  int64_t in() const { return in_; }
  plan::Shard split() const { return split_; }
  const WeightRef& weight() const { return w_; }
  explicit operator bool() const { return bool(w_); }

  // Whether this layer's GEMMs take 16-bit operands, and which type they take.
  bool low_precision(const LayerEnv& env) const { return w_.lp && env.cast && env.cast->active(); }
  kernels::DType operand_dtype(const LayerEnv& env) const {
    return low_precision(env) ? env.cast->dtype() : kernels::DType::kF32;
  }
  // x [rows, in] for several of this layer's (or its siblings') GEMMs: rounded once into the
  // pinned ComputeCast slot when they take 16-bit operands, else x as it is.
  GemmInput pin(const LayerEnv& env, const float* x, int64_t rows) const;
  // Whether the producer of this layer's output gradient may write it in the compute type,
  // into ComputeCast slot 0 (ComputeCast::slot_view): 16-bit GEMMs, and no WeightGradDeferral
  // active (a deferred weight GEMM keeps dy in fp32).
  bool dy_in_16bit(const LayerEnv& env) const { return low_precision(env) && !WeightGradDeferral::active(); }

  // y [rows, out] = x W^T (beta = 1: += ).
  void forward(const LayerEnv& env, float* y, GemmInput x, int64_t rows, float beta = 0.0f) const;
  // dx [rows, in] (= or +=, by dx_beta) dy W — skipped when dx is null — and dW += dy^T x, where
  // dW is the weight's gradient unless given; under a WeightGradDeferral dW's GEMM is queued,
  // its inputs kept (copied where later kernels overwrite them) and rounded when it runs.
  void backward(const LayerEnv& env, float* dx, GemmInput dy, GemmInput x, int64_t rows, float dx_beta = 0.0f,
                float* dW = nullptr) const;

 private:
  WeightRef w_;
  int64_t out_ = 0, in_ = 0;
  plan::Shard split_ = plan::Shard::kReplicated;
};

}  // namespace dstrain::model
