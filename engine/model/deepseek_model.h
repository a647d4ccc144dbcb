// The DeepSeek model (docs/model.md §3, §5): embedding, decoder layers (MLA + dense MLP or MoE),
// final norm, untied LM head, cross-entropy, balance loss and optional MTP modules — explicit
// forward and backward, no autograd. Written once against kernels::Backend and
// model::Collectives; sizes are this rank's local shard sizes.
#pragma once

#include <memory>
#include <vector>

#include "engine/model/ffn.h"
#include "engine/model/mla.h"

namespace dstrain::model {

class DecoderLayer {
 public:
  DecoderLayer(const LayerEnv& env, int64_t index, int64_t B, int64_t S, const RopeTables* rope);
  void forward(float* h_out, const float* h_in, int64_t B, int64_t S, const LossScale& scale);
  // dh: in dL/dh_out, out dL/dh_in. tmp1/tmp2: [N,H] work buffers owned by the model.
  void backward(float* dh, const float* h_in, int64_t B, int64_t S, float* tmp1, float* tmp2);

  MoeLayer* moe() { return moe_.get(); }
  int64_t saved_floats() const;
  int64_t scratch_floats(int64_t N) const;

 private:
  LayerEnv env_;
  int64_t H_;
  float eps_;
  WeightRef in_norm_, post_norm_;
  MlaAttention attn_;
  std::unique_ptr<SwiGluMlp> mlp_;
  std::unique_ptr<MoeLayer> moe_;
  std::vector<float> a_, rstd1_, h_mid_, u_, rstd2_;
};

struct Losses {
  double ce = 0, aux = 0, mtp = 0;
  double total() const { return ce + aux + mtp; }
};

class DeepSeekModel {
 public:
  // B x S tokens per forward (the micro-batch). tp_size > 1 expects a Collectives that reduces.
  DeepSeekModel(const config::ModelConfig& cfg, kernels::Backend& be, Collectives& coll,
                ParamStore& params, int64_t B, int64_t S, int tp_size = 1);
  ~DeepSeekModel();

  // tokens [B, S+1]: inputs T[:, :S], targets T[:, 1:] (-100 ignored). Keeps what backward needs.
  Losses forward(const int32_t* tokens, const LossScale& scale);
  // Accumulates this micro-batch's gradients into the parameter store, telling `observer` (if
  // set) as each layer's gradients become final — layers numbered as plan::ParamInfo::layer
  // (docs/design.md §5.4), in the order backward_order() lists — and polling it between kernels.
  void backward();
  void set_backward_observer(BackwardObserver* observer) { progress_.observer = observer; }
  // The layers in the order backward() finishes them: the head (final norm and LM head, which
  // the MTP modules share) and the MTP modules together first, then the decoder layers from
  // the last, the embedding (-1) last.
  static std::vector<int64_t> backward_order(const config::ModelConfig& cfg);

  // With keep_logits, forward copies the main head's logits [B*S, V] here before the loss.
  void keep_logits(bool on) { keep_logits_ = on; }
  const std::vector<float>& logits() const { return kept_logits_; }

  // MoE layers in order (main model, then MTP), for load statistics and the bias update.
  std::vector<MoeLayer*> moe_layers();

  // Bytes of activations kept between forward and backward, and of backward temporaries.
  int64_t saved_activation_bytes() const;
  int64_t workspace_bytes() const;

 private:
  struct Mtp;  // one multi-token-prediction module
  double head_loss(float* logits, const float* h, float* z, float* rstd, const WeightRef& norm,
                   const int32_t* targets, int64_t rows, double grad_scale);
  void mtp_forward(const int32_t* tokens, const LossScale& scale, Losses& out);
  void mtp_backward(float* dz);

  const config::ModelConfig& cfg_;
  kernels::Backend& be_;
  Progress progress_;
  LayerEnv env_;
  Scratch scratch_;
  std::vector<float> ones_;
  RopeTables rope_;
  int64_t B_, S_, H_, V_, L_;
  WeightRef embed_, norm_, lm_head_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  std::vector<std::unique_ptr<Mtp>> mtp_;
  std::vector<int32_t> ids_, targets_;
  std::vector<std::vector<float>> hidden_;  // h_0 ... h_L, [N,H] each
  std::vector<float> z_, rstd_f_, logits_, loss_rows_, dz_, dh_, tmp1_, tmp2_, kept_logits_;
  bool keep_logits_ = false;
};

}  // namespace dstrain::model
