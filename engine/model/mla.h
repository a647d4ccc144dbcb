// Multi-head latent attention (docs/model.md §3.4), forward and backward, on this rank's heads.
#pragma once

#include <array>
#include <vector>

#include "engine/model/layer_env.h"
#include "engine/model/linear.h"

namespace dstrain::model {

// RoPE tables (fp32, as HF computes them, on the host, then copied to the backend's device) and
// the softmax scale, YaRN included (§3.4.1).
struct RopeTables {
  kernels::DeviceArray<float> cos, sin;  // [S, dr/2]
  float attention_scale = 1.0f;
};
RopeTables make_rope_tables(const config::ModelConfig& m, int64_t S, kernels::Backend& be);

class MlaAttention {
 public:
  // `prefix` is "model.layers.{i}."; B x S tokens at most.
  MlaAttention(const LayerEnv& env, const std::string& prefix, int64_t B, int64_t S,
               const RopeTables* rope);

  // out [N,H] = this rank's heads' part of o_proj(attention(a)), before the sum over the
  // tensor-parallel ranks and without o_proj's bias (the caller reduces, then adds it once:
  // add_output_bias). a [N,H]: the normed layer input of all tokens (kept by the caller).
  void forward(float* out, const float* a, int64_t B, int64_t S);
  void add_output_bias(float* x, int64_t rows);
  // da [N,H] (overwritten, complete: summed over the tensor-parallel ranks) from dout [N,H] (the
  // complete gradient of the layer's output, all tokens); accumulates parameter gradients.
  void backward(float* da, const float* dout, const float* a, int64_t B, int64_t S);
  // Rewrites the selective set (the normed latents, the attention core's output and
  // log-sum-exp) from the kept buffers, as forward computed them.
  void recompute_selective(int64_t B, int64_t S);

  int64_t scratch_floats(int64_t N) const;  // forward and backward temporaries

 private:
  std::array<kernels::ConstView, 3> qkv_for_attention();  // Q, K, V as attention reads them
  void attention_core(int64_t B, int64_t S);                        // O and lse from Q, K, V
  void norm_latent(const ActBuf& out, float* rstd, const float* x, const float* w, int64_t N, int64_t d);
  LayerEnv env_;
  const RopeTables* rope_;
  int64_t H_, nh_, dn_, dr_, dv_, dqk_, rq_, rkv_;
  bool lora_;
  // kv_a_proj_with_mqa [rkv + dr, H] as its two GEMMs read it: the latent rows (ckv_proj_) and
  // the rope-key rows (kpe_proj_).
  Linear q_a_, q_b_, q_, ckv_proj_, kpe_proj_, kv_b_, o_;
  WeightRef q_a_norm_, kv_a_norm_;
  WeightRef q_a_bias_, kv_a_bias_, o_bias_;  // only with attention_bias
  // Saved for backward (per token): cq, rstd_q, cqn | ckv, kpe, rstd_kv, ckvn | Q, K, V, O | lse;
  // the selective set: cqn, ckvn, O, lse. cqn, ckvn, Q, K, V in the compute type under bf16 / fp16.
  ActBuf cq_, rstd_q_, cqn_, ckv_, kpe_, rstd_kv_, ckvn_, Q_, K_, V_, O_, lse_;
};

}  // namespace dstrain::model
