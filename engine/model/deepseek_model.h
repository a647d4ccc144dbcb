// The DeepSeek model (docs/model.md §3, §5): embedding, decoder layers (MLA + dense MLP or MoE),
// final norm, untied LM head, cross-entropy, balance loss and optional MTP modules — explicit
// forward and backward, no autograd. Written once against kernels::Backend and
// model::Collectives; sizes are this rank's local shard sizes.
//
// Tensor parallelism (docs/model.md §10.1): attention heads and the dense / shared-expert MLP
// widths are split (column- then row-parallel, one reduction after each block); the embedding
// and lm_head are split by vocabulary rows (the lookup sums over the ranks, the cross-entropy is
// computed vocabulary-parallel, the [tokens, V] logits never gathered); the routed experts run
// whole on every rank, each on its part of the tokens. With sequence parallelism the norm and
// residual regions hold this rank's token part only: an all-gather before each block, a
// reduce-scatter after it. The MTP modules run without sequence parallelism.
#pragma once

#include <memory>
#include <vector>

#include "engine/model/ffn.h"
#include "engine/model/mla.h"

namespace dstrain::model {

class DecoderLayer {
 public:
  // With env.sp, the layer's input and output are the rows of this rank's token part. Its saved
  // buffers come from env.acts, placed by `recompute` (engine/model/activations.h).
  DecoderLayer(const LayerEnv& env, int64_t index, int64_t B, int64_t S, const RopeTables* rope,
               Recompute recompute = Recompute::kNone);
  void forward(float* h_out, const float* h_in, int64_t B, int64_t S, const LossScale& scale);
  // dh: in dL/dh_out, out dL/dh_in (this rank's rows). tmp1/tmp2: [N,H] work buffers. h_in: the
  // forward's input, unchanged; a recomputing layer first rewrites what it did not keep.
  void backward(float* dh, const float* h_in, int64_t B, int64_t S, float* tmp1, float* tmp2);

  MoeLayer* moe() { return moe_.get(); }
  int64_t rows() const { return rows_; }  // token rows of the input and output on this rank
  Recompute recompute() const { return recompute_; }
  int64_t scratch_floats(int64_t N) const;

 private:
  const float* gathered(const float* part, float* full) const;
  void reduce_into(float* out, float* partial) const;
  void norm_backward(float* dx, const WeightRef& w, const float* dy, const float* x, const float* rstd);

  void recompute(float* h_out, const float* h_in, int64_t B, int64_t S);

  LayerEnv env_;
  Recompute recompute_;
  LossScale scale_;  // the last forward's (a full recomputation repeats it)
  int64_t H_, N_, rows_;
  TokenPart part_;  // the tokens this rank routes (and holds, with sequence parallelism)
  float eps_;
  WeightRef in_norm_, post_norm_;
  MlaAttention attn_;
  std::unique_ptr<SwiGluMlp> mlp_;
  std::unique_ptr<MoeLayer> moe_;
  ActBuf a_, rstd1_, h_mid_, u_, rstd2_;  // the normed inputs a and u: selective
  kernels::DeviceArray<float> dw_;
};

// What a model instance needs only while it runs a forward or a backward, never between them:
// the backward's scratch arena, the GEMMs' conversion workspaces, the expert-parallel backward
// buffers, the [N, H] work buffers, the sequence-parallel gathers and one chunk of the head's
// logits with their reductions. The instances one pipeline rank runs one at a time share one
// (StageSpec::workspace; docs/design.md §7.4), which grows to the largest instance's needs —
// so each micro-batch in flight holds only what its backward reads (its saved activations, the
// head's input gradient, its input gradient on its way to the previous stage). A zero-bubble W
// queue copies what it keeps from here (mark_workspace_volatile).
struct InstanceWorkspace {
  Scratch scratch;
  std::unique_ptr<ComputeCast> cast;
  EpBackwardBuffers ep;
  kernels::DeviceArray<float> tmp1, tmp2, full, logits, row_max, row_sums, loss_rows, norm_dw;
  kernels::DeviceArray<float> dh_first;  // the running gradient of a first stage's instance (never sent)
  int64_t bytes() const;
};

// The part of the model one pipeline stage runs (docs/design.md §6.6): decoder layers
// [first_layer, end_layer), the embedding on the first stage, the final norm, lm_head and the MTP
// modules on the last. A last stage with MTP modules but without the embedding reads the
// embedding from `embed_table` (fp32, or the compute type under mixed precision) and adds its
// gradient to `embed_g` (a mirror of the first stage's
// table, kept in sync by the pipeline runtime, as Megatron's embedding group does).
// `recompute` applies to the first `recompute_layers` decoder layers of the stage (-1: all of
// them; the MTP modules' layers always keep their activations).
struct StageSpec {
  int64_t first_layer = 0, end_layer = -1;  // -1: num_hidden_layers
  bool embedding = true, head = true;
  kernels::ConstView embed_table;
  float* embed_g = nullptr;
  Recompute recompute = Recompute::kNone;
  int64_t recompute_layers = -1;
  // Where the workspace lives: one for all instances of a pipeline rank (they run one at a
  // time); null: the instance's own.
  std::shared_ptr<InstanceWorkspace> workspace;
  // Where the recomputed buffers live: one arena for all instances of a pipeline rank (they run
  // one at a time); null: the instance's own.
  std::shared_ptr<RecomputeArena> recompute_arena;
  // Token rows per chunk of the LM head and cross-entropy (plan::loss_chunk_rows; 0: its default).
  int64_t loss_chunk_rows = 0;
};

struct Losses {
  double ce = 0, aux = 0, mtp = 0;
  double total() const { return ce + aux + mtp; }
};

class DeepSeekModel {
 public:
  // B x S tokens per forward (the micro-batch). Tensor parallelism comes from `coll`
  // (tp_size() ranks); `sequence_parallel` splits the norm and residual regions by tokens.
  // `stage`: the part of the model this instance runs (default: all of it).
  DeepSeekModel(const config::ModelConfig& cfg, kernels::Backend& be, Collectives& coll,
                ParamStore& params, int64_t B, int64_t S, bool sequence_parallel = false,
                const StageSpec& stage = {});
  ~DeepSeekModel();

  // tokens [B, S+1]: inputs T[:, :S], targets T[:, 1:] (-100 ignored). Keeps what backward needs.
  Losses forward(const int32_t* tokens, const LossScale& scale) { return forward_stage(tokens, nullptr, scale); }
  // A pipeline stage's forward: from the embedding on the first stage, else from `h_in`
  // [boundary_rows(), H] (the previous stage's output()). The losses are those of this stage:
  // CE and MTP on the last stage, the balance loss of its MoE layers.
  Losses forward_stage(const int32_t* tokens, const float* h_in, const LossScale& scale);
  const float* output() const { return hidden_.back().data(); }
  int64_t boundary_rows() const { return rows_; }  // token rows crossing a stage boundary on this rank
  // A pipeline stage's backward from `dh_out` (dL/d output(); null on the last stage), leaving
  // dL/dh_in in input_grad() (not on the first stage).
  void backward_stage(const float* dh_out);
  const float* input_grad() const { return dh_->data(); }
  // Registers the buffers a backward pass overwrites as it goes (its workspace) with a deferral,
  // so that the weight-gradient GEMMs it queues copy what they read from them.
  void mark_workspace_volatile(WeightGradDeferral& d) const;
  bool first_stage() const { return has_embed_; }
  bool last_stage() const { return has_head_; }
  // Accumulates this micro-batch's gradients into the parameter store, telling `observer` (if
  // set) as each layer's gradients become final — layers numbered as plan::ParamInfo::layer
  // (docs/design.md §5.4), in the order backward_order() lists — and polling it between kernels.
  void backward() { backward_stage(nullptr); }
  void set_backward_observer(BackwardObserver* observer) { progress_.observer = observer; }
  // The layers in the order backward() finishes them: the head (final norm and LM head, which
  // the MTP modules share) and the MTP modules together first, then the decoder layers from
  // the last, the embedding (-1) last.
  static std::vector<int64_t> backward_order(const config::ModelConfig& cfg);

  // With keep_logits, forward copies the main head's logits [B*S, V] here, chunk by chunk,
  // before the loss (this rank's vocabulary columns under tensor parallelism).
  void keep_logits(bool on) { keep_logits_ = on; }
  const std::vector<float>& logits() const { return kept_logits_; }
  int64_t loss_chunk_rows() const { return chunk_; }  // token rows per chunk of the LM head (0: no head)

  // The hidden state entering decoder layer i (i = L: the last layer's output), this rank's
  // rows, copied to the host.
  std::vector<float> hidden_state(int64_t i) const;

  // MoE layers in order (main model, then MTP), for load statistics and the bias update, and
  // their layer numbers (MTP module k: num_hidden_layers + k - 1).
  std::vector<MoeLayer*> moe_layers();
  std::vector<int64_t> moe_layer_ids() const;

  // Bytes of activations kept between forward and backward (the recomputed layers' shared
  // buffers included), and of backward temporaries.
  int64_t saved_activation_bytes() const;
  const ActivationStore& activation_store() const { return acts_; }
  // The same without the recompute arena (which other instances may share).
  int64_t own_activation_bytes() const;
  // The backward temporaries: this instance's own (the head's input gradient, its input
  // gradient, the bias ones, the MTP modules' running gradients), and with the shared workspace.
  int64_t own_workspace_bytes() const;
  int64_t workspace_bytes() const { return own_workspace_bytes() + ws_->bytes(); }
  const InstanceWorkspace& shared_workspace() const { return *ws_; }
  // Of the saved activations, the bytes of the norm and residual regions (the hidden states
  // between layers, the normed inputs, the residual sums): what sequence parallelism divides.
  int64_t residual_region_bytes() const;

 private:
  struct Mtp;  // one multi-token-prediction module
  void map_ids(int32_t* local, const int32_t* ids, int64_t n) const;
  void embed(float* out, const int32_t* local_ids, int64_t n);
  // The LM head and cross-entropy of `rows` normed states z, chunk by chunk: the summed loss
  // times `weight`. With dz, the head's backward too: dz = dlogits W_lm (this rank's vocabulary
  // columns' part), dW_lm += dlogits^T z, the logits' gradient scaled by weight * loss_scale.
  // `keep`: copy the logits to kept_logits_.
  double head_loss(const float* z, const int32_t* targets, int64_t rows, double weight, double loss_scale, float* dz,
                   bool keep);
  void mtp_forward(const int32_t* tokens, const LossScale& scale, Losses& out);
  void mtp_backward(float* dz);

  const config::ModelConfig& cfg_;
  kernels::Backend& be_;
  Collectives& coll_;
  Progress progress_;
  LayerEnv env_, mtp_env_;  // the MTP modules' layers run without sequence parallelism
  std::shared_ptr<InstanceWorkspace> ws_;  // scratch, conversions, work buffers: shared by a rank's instances
  ActivationStore acts_;
  kernels::DeviceArray<float> ones_;
  std::vector<float> loss_host_;  // the per-row losses, copied to the host
  RopeTables rope_;
  int64_t B_, S_, H_, V_, L_;
  int64_t first_ = 0, end_ = 0;  // this instance's decoder layers
  bool has_embed_ = true, has_head_ = true;
  int tp_ = 1;
  bool sp_ = false;
  TokenPart part_;        // with sequence parallelism, this rank's token rows
  int64_t rows_ = 0;      // token rows of the hidden states on this rank
  int64_t v0_ = 0, Vl_ = 0;  // this rank's vocabulary rows [v0, v0 + Vl)
  int64_t chunk_ = 0;        // token rows per chunk of the head (logits_ holds one chunk)
  WeightRef embed_, norm_;
  Linear lm_head_;  // this rank's vocabulary rows (vocabulary-parallel)
  kernels::ConstView embed_table_;  // what the lookup reads: the fp32 table or its compute copy
  std::vector<std::unique_ptr<DecoderLayer>> layers_;
  std::vector<std::unique_ptr<Mtp>> mtp_;
  // The micro-batch's token ids and targets, made on the host from the batch and copied to the
  // device (local_ids: rows of this rank's vocabulary shard, -1 for another rank's).
  std::vector<int32_t> ids_host_, local_ids_host_, targets_host_;
  kernels::DeviceArray<int32_t> local_ids_, targets_;
  // This instance's own buffers, on the backend's device (docs/design.md §6.1).
  std::vector<kernels::DeviceArray<float>> hidden_;  // h_first ... h_end, [rows, H] each
  kernels::DeviceArray<float> z_, z_full_, rstd_f_, dz_, own_dh_;
  // The backward's running gradient, dL/dh_in at the end: the instance's own where it is sent to
  // the previous stage (asynchronously, so it outlives the backward), else the shared workspace's.
  kernels::DeviceArray<float>* dh_ = &own_dh_;
  std::vector<float> kept_logits_;  // host copy
  bool keep_logits_ = false;
};

}  // namespace dstrain::model
