// The feed-forward blocks: a SwiGLU MLP (dense layers and the shared experts) and the MoE layer
// (router, routed experts, shared experts, balance loss) of docs/model.md §3.5-3.6 and §5.2.
#pragma once

#include <memory>
#include <vector>

#include "engine/model/layer_env.h"
#include "engine/model/linear.h"

namespace dstrain::model {

// down(silu(gate(u)) * up(u)) with gate and up fused into one [2w, H] GEMM (their parameters
// are adjacent in the flat buffer). `w` is this rank's (tensor-parallel) width. Column- then
// row-parallel: forward's output and backward's input gradient are this rank's parts of sums
// over the tensor-parallel ranks, which the caller reduces (once for everything it adds up).
class SwiGluMlp {
 public:
  SwiGluMlp(const LayerEnv& env, const std::string& prefix, int64_t width, int64_t max_tokens);
  void forward(float* out, const float* u, int64_t N);  // out [N,H] overwritten
  // du [N,H]: overwritten (beta 0) or accumulated (beta 1).
  void backward(float* du, const float* dout, const float* u, int64_t N, float beta);
  void recompute_selective(int64_t N);  // M = swiglu(GU) again
  int64_t scratch_floats(int64_t N) const { return N * (3 * w_ + H_) + 64; }

 private:
  LayerEnv env_;
  int64_t H_, w_;
  void activate(int64_t N);  // M = swiglu(GU)
  Linear gate_up_, down_;  // gate_proj and up_proj as one [2w, H] weight; down_proj
  ActBuf GU_, M_;  // M: selective; in the compute type under bf16 / fp16
};

// Everything a forward measures for training-time rules: the balance loss of this call and the
// tokens routed to each expert (for the aux-loss-free bias update).
struct MoeStats {
  double aux_loss = 0.0;
  std::vector<int64_t> loads;  // [E], summed over forwards until cleared
  // Under expert parallelism: the rows this rank's experts received in one forward, at most (the
  // receive side's high water), against the balanced count its buffers were first sized for.
  int64_t recv_rows_max = 0, recv_rows_balanced = 0;
};

// Scale of this micro-batch's losses within the global batch.
struct LossScale {
  double tokens = 1;     // target tokens of the global batch (CE is their mean)
  double sequences = 1;  // sequences of the global batch (the balance loss is their mean)
  double gradient = 1;   // the fp16 loss scale: multiplies the gradient of every loss, not its value
  // false: a pass for the loss only (validation, generation), never followed by backward — the
  // LM head, whose weight gradient is computed during forward (docs/design.md §6.13), skips it.
  bool backward = true;
};

// Expert parallelism: the ranks of the expert-parallel group own contiguous blocks of E / EP
// experts. Each rank routes its own tokens; the counts per expert are summed over the group,
// the token rows go to their experts' owners with an all-to-all-v, run there grouped by local
// expert, and come back the same way (dropless: every row, whatever the imbalance); the shared
// experts compute while the rows travel. Backward mirrors it.
// Under tensor parallelism the routed experts are not split (expert-TP = 1): each rank routes
// the tokens of its TokenPart and runs them through its experts, and the shared experts are
// column- then row-parallel over all tokens. Both leave this rank's parts of sums over the
// tensor-parallel ranks in one [N, H] buffer, which the caller reduces once (an all-reduce, or a
// reduce-scatter with sequence parallelism). The balance loss sums its per-sequence statistics
// over the ranks, so every rank computes the same loss.
class MoeLayer {
 public:
  MoeLayer(const LayerEnv& env, const std::string& prefix, int64_t B, int64_t S);
  // out_full [N,H] (overwritten): the shared experts' part (all tokens) plus the routed output
  // in the rows of `part`. u_full [N,H]: all tokens (read by the shared experts; may be null
  // without them); u_part: the rows of `part`.
  void forward(float* out_full, const float* u_full, const float* u_part, TokenPart part, int64_t B, int64_t S,
               const LossScale& scale);
  // du_full [N,H] (overwritten): this rank's part of the input gradient, likewise. dout_full: the
  // complete gradient of the output, all tokens.
  void backward(float* du_full, const float* dout_full, const float* u_full, const float* u_part, TokenPart part,
                int64_t B, int64_t S);
  // Forward again under full recomputation: the same outputs and saved buffers, without adding
  // to the balance loss, the expert loads or the fault counter a second time.
  void set_recomputing(bool on) { recomputing_ = on; }
  // Rewrites the selective set (dispatched rows, expert and shared-expert activations).
  void recompute_selective(const float* u_part, int64_t N);

  MoeStats& stats() { return stats_; }
  float* router_bias() { return bias_; }  // null for deepseek_v2
  // The last forward's selection: expert ids [tokens routed here, k], for this rank's token part
  // (copied from the device).
  std::vector<int32_t> selection() const;
  // The balance loss this layer's forwards add up (docs/model.md §5.2) is kept on the device:
  // cleared before a micro-batch's forward, read once after it.
  void clear_aux();
  double fetch_aux();
  int64_t top_k() const { return k_; }
  int64_t scratch_floats(int64_t N) const;

 private:
  void route(const float* u, int64_t n);
  void balance_loss(TokenPart part, int64_t B, int64_t S, const LossScale& scale);
  void plan_exchange(int64_t rows);
  void dispatch_rows(const float* u_part, int64_t rows);  // Xp = the rows of u_part in expert order
  void swiglu_into(kernels::View M, const float* GU, int64_t rows);
  void experts_forward(kernels::ConstView X, float* GU, kernels::View M, float* Y, const int64_t* cnt,
                       const int64_t* off, int64_t e_first, int64_t ne, int64_t rows);
  // dY16: dY already in the GEMMs' 16-bit type (written so by its producer; dY then null), or none.
  void experts_backward(float* dX, const float* dY, kernels::ConstView X, const float* GU, kernels::ConstView M,
                        float* dM, float* dGU, const int64_t* cnt, const int64_t* off, int64_t e_first, int64_t ne,
                        int64_t rows, kernels::ConstView dY16 = {});
  // Whether the experts' 16-bit GEMM inputs of backward (dY, dGU) are written by their producers
  // in the compute type (ComputeCast slot 0): 16-bit GEMMs, and no WeightGradDeferral, whose
  // queued GEMMs keep fp32 copies.
  bool producers_write_16bit() const;
  static std::vector<int64_t> scaled(const std::vector<int64_t>& rows, int64_t width);

  LayerEnv env_;
  kernels::RouterParams rp_;
  int64_t H_, E_, k_, I_;
  Linear gate_;  // the router: replicated, read in fp32
  float* bias_ = nullptr;
  std::vector<Linear> gate_up_, down_;  // per expert (empty where another expert-parallel rank holds it)
  std::unique_ptr<SwiGluMlp> shared_;
  // Saved: router outputs, the dispatch plan and the experts' activations (rows sorted by expert);
  // the selective set: Xp (the dispatched rows) and Mp. Under bf16 / fp16 both are kept in the
  // compute type (only GEMMs read them; Xp stays fp32 under expert parallelism, where it is sent).
  ActBuf scores_, w_, dscores_, Xp_, GUp_, Mp_, Yp_;
  // The selection, the dispatch plan (pos, src) and the rows per expert are made on the device
  // (Backend::moe_plan); the host reads only the counts. The balance loss's statistics [2, B, E]
  // and its running value stay there too. The expert-parallel permutations are made on the host
  // from the exchanged counts and copied over.
  kernels::DeviceArray<int32_t> idx_dev_, pos_dev_, src_dev_, counts_dev_, to_source_dev_, to_expert_dev_;
  kernels::DeviceArray<float> balance_stats_, aux_dev_;
  std::vector<int32_t> counts32_;
  std::vector<int64_t> counts_, offsets_;
  int64_t routed_ = 0;  // tokens the last forward routed
  MoeStats stats_;
  std::string prefix_;  // "model.layers.i."
  // Expert parallelism (ep_ > 1): this rank owns experts [e0_, e0_ + El_); the last forward's
  // exchange (rows to and from each rank, the received rows per local expert, the permutations
  // between the received order and the grouped one) and the owner side's saved activations
  // (from the activation store; Xe and Me selective, Ye and Yr forward-only), then the backward
  // buffers.
  int ep_ = 1;
  int64_t El_ = 0, e0_ = 0, recv_total_ = 0;
  std::vector<int64_t> send_rows_, recv_rows_, ecounts_, eoffsets_;
  std::vector<int32_t> to_source_, to_expert_;
  kernels::DeviceArray<float> *Xr_ = nullptr, *Xe_ = nullptr, *GUe_ = nullptr, *Me_ = nullptr, *Ye_ = nullptr,
                              *Yr_ = nullptr;
  int64_t bad_counts_at_ = 0, forwards_ = 0;  // fault injection (Fault::kEpBadCounts)
  bool recomputing_ = false;
};

// b_i += gamma * sign(mean(load) - load_i) (docs/model.md §5.3), after each optimizer step, with
// loads summed over the whole global batch.
void update_router_bias(float* bias, const int64_t* loads, int64_t E, float gamma);

}  // namespace dstrain::model
