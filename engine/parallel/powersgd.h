// PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, 2019), with the semantics of
// PyTorch's DDP communication hook `powerSGD_hook` and its `PowerSGDState` (docs/design.md §6.5,
// "PowerSGD"). One PowerSgd reduces one flat gradient buffer over one data-parallel group:
//
//   * every gradient tensor of two or more dimensions is a matrix M [n, m] (n its first
//     dimension, m the product of the others, as PyTorch views it); it is compressed when
//     n m > min_compression_rate (n + m) r, r = min(rank, n, m). Everything else (norm
//     weights, biases, small matrices, padding) is summed whole;
//   * with error feedback, the error of the last step is added to the gradient first;
//   * P = M Q is summed over the ranks together with the tensors sent whole (one all-reduce),
//     P orthogonalised (Gram-Schmidt), Q = M^T P summed (a second all-reduce), and the
//     approximation P Q^T written over M;
//   * Q starts as i.i.d. standard normals, the same on every rank (counter-based, from the seed
//     and the step); with warm_start each step starts from the last step's summed Q (a column
//     of it that came out zero drawn afresh: below).
//
// Scaling. dstrain's gradients are pre-divided (each rank's loss is scaled so that the sum over
// the ranks is the mean gradient; docs/design.md §6.5), where PyTorch's hook divides the sum by
// the world size. The result here is therefore the sum, P P^T Σ_r M_r, and a rank's error is its
// input less the result divided by the world size W — PyTorch's error, divided by W as every
// gradient here is. With fp16 the gradients carry the loss scale: the error is kept divided by
// the scale of its step and multiplied by the next step's, so a scale change moves it along; a
// step whose result is not finite (an fp16 overflow anywhere in the buffer, which the trainer
// skips) resets the error and Q instead of carrying NaN into every later step.
//
// A zero column of P (a gradient matrix that is all zeros, e.g. an expert no token reached) is
// left zero rather than divided by its norm (PyTorch's epsilon 0 would give NaN there), and so is
// a column that rounding alone made non-zero (a gradient of lower rank than the approximation:
// normalised, that noise would be a direction not orthogonal to the others, and P P^T no
// projection). Such a column of P makes its column of Q zero, which warm start would keep for
// ever (P = M Q finds nothing along it); a zero column of Q is therefore drawn afresh, from the
// normals of the next step's key.
//
// Host memory only (the engine refuses the compression where gradients live on a GPU).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "engine/comm/communicator.h"
#include "engine/parallel/zero/partition.h"
#include "engine/plan/powersgd_layout.h"

namespace dstrain::parallel {

struct PowerSgdOptions {
  int64_t rank = 1;
  int64_t start_iter = 1000;
  double min_compression_rate = 2.0;
  bool use_error_feedback = true;
  bool warm_start = true;
  uint64_t seed = 0;
};

using plan::PowerSgdLayout;
using plan::PowerSgdMatrix;
using plan::PowerSgdTensor;
using plan::powersgd_layout;

class PowerSgd {
 public:
  // `backend`: runs the factors' GEMMs (host memory). `name` keys the random Q ("dense",
  // "expert") and the checkpoint state.
  PowerSgd(PowerSgdLayout layout, const PowerSgdOptions& options, kernels::Backend& backend, std::string name);

  // Compressed sum over `group` of the `layout.length` gradients at `grads` (in place), for the
  // step numbered `step` (0-based) whose gradients carry `grad_scale` (the fp16 loss scale, else 1).
  void reduce(comm::Communicator& group, float* grads, int64_t step, double grad_scale);

  const PowerSgdLayout& layout() const { return layout_; }
  const std::string& name() const { return name_; }
  // The state a resume needs to continue bit for bit: the error (divided by its step's scale)
  // and the warm-start Q, each absent while it has none, and the digest of the layout they
  // belong to ("error_NAME", "q_NAME", "layout_NAME").
  std::map<std::string, std::vector<float>> state() const;
  // Restores state(); a part absent from `s` starts afresh. Throws Error when `s` belongs to
  // another layout (the digest, or a size, differs); nothing is restored then.
  void restore(const std::map<std::string, std::vector<float>>& s);
  // Host memory held: the error, Q and the staging of the whole part and P.
  int64_t bytes() const;

 private:
  PowerSgdLayout layout_;
  PowerSgdOptions options_;
  kernels::Backend& be_;
  std::string name_;
  std::vector<float> error_;  // empty: none yet
  std::vector<float> q_;      // the summed Q of the last step; empty: none
  std::vector<float> stage_;  // the whole part, then P
};

// Gram-Schmidt on the r columns of the row-major [n, r] matrix `a`, in double: each column
// normalised, then removed from the ones after it. A column left with less than
// kOrthoRelativeTolerance of its norm once the earlier ones are removed (a gradient of lower rank
// than the approximation's: float rounding is all that is left of it) is zeroed, as is a zero
// column. Exposed for tests.
inline constexpr double kOrthoRelativeTolerance = 1e-5;
void orthogonalize_columns(float* a, int64_t n, int64_t r);

}  // namespace dstrain::parallel
