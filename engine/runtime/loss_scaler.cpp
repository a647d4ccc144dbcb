#include "engine/runtime/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "engine/common/error.h"

namespace dstrain::runtime {

LossScaler::LossScaler(const config::Fp16Config& c)
    : dynamic_(c.loss_scale == 0.0), min_scale_(c.min_loss_scale), window_(c.loss_scale_window),
      hysteresis_(c.hysteresis), consecutive_(c.consecutive_hysteresis) {
  s_.scale = dynamic_ ? std::ldexp(1.0, int(c.initial_scale_power)) : c.loss_scale;
  s_.hysteresis = hysteresis_;
}

LossScaler::Update LossScaler::update(bool overflow) {
  Update u;
  u.attempted = s_.scale;
  u.skip = overflow;
  if (!dynamic_) {  // a static scale: an overflowing step is skipped, the scale stays
    if (overflow) {
      ++s_.skipped;
      u.message = fmt::format("fp16 gradients overflowed at the static loss scale {:g}: step skipped", s_.scale);
    }
    ++s_.iter;
    u.next = s_.scale, u.hysteresis = s_.hysteresis;
    return u;
  }
  if (overflow) {
    ++s_.skipped;
    if (hysteresis_ == 1 || s_.hysteresis == 1) {  // out of tolerance: halve (not below the minimum)
      if (s_.scale == min_scale_)
        throw Error(fmt::format("fp16 gradients overflowed at the minimum loss scale {:g} (fp16.min_loss_scale): "
                                "training on would apply garbage, so the run stops; the last checkpoint is intact. "
                                "Try bf16, a lower learning rate or gradient_clipping",
                                min_scale_));
      const double next = std::max(s_.scale / factor_, min_scale_);
      u.message = fmt::format("fp16 gradients overflowed at loss scale {:g}: step skipped, scale {:g} -> {:g}", s_.scale,
                              s_.scale, next);
      s_.scale = next;
    } else {  // tolerated: spend one unit of hysteresis, keep the scale
      u.message = fmt::format("fp16 gradients overflowed at loss scale {:g}: step skipped, scale kept (hysteresis {} "
                              "-> {})",
                              s_.scale, s_.hysteresis, s_.hysteresis - 1);
      --s_.hysteresis;
    }
    s_.last_overflow_iter = s_.iter;
  } else {
    if (consecutive_) s_.hysteresis = hysteresis_;  // a clean step refills the tolerance
    const int64_t clean = s_.iter - s_.last_overflow_iter - 1;  // clean updates before this one since the overflow
    if (clean > 0 && clean % window_ == 0) {
      if (!consecutive_) s_.hysteresis = hysteresis_;
      s_.scale *= factor_;
    }
  }
  ++s_.iter;
  u.next = s_.scale, u.hysteresis = s_.hysteresis;
  return u;
}

}  // namespace dstrain::runtime
