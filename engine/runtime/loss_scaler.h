// fp16 loss scaling with DeepSpeed's rules (docs/design.md §6.9): the loss is multiplied by the
// scale before backward, the gradients divided by it before the optimizer; a step whose
// gradients overflowed (inf or NaN anywhere) is skipped. Dynamic scaling halves the scale after
// `hysteresis` overflows and doubles it after `loss_scale_window` clean steps, as
// deepspeed/runtime/fp16/loss_scaler.py's DynamicLossScaler does (its current form: the window
// counts the clean steps strictly after the last overflow). Pure state, no I/O: the trainer asks
// it, logs what it answers and stores state() in checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include "engine/config/train_config.h"

namespace dstrain::runtime {

struct LossScalerState {  // what a checkpoint keeps (bit-exact resume)
  double scale = 1.0;
  int64_t iter = 0;                 // updates so far
  int64_t last_overflow_iter = -1;  // the update of the last overflow (-1: none)
  int64_t hysteresis = 1;           // overflows still tolerated before the scale halves
  int64_t skipped = 0;              // steps skipped for overflow so far
};

class LossScaler {
 public:
  // fp16.loss_scale > 0: that static scale; 0: dynamic from 2^initial_scale_power.
  explicit LossScaler(const config::Fp16Config& c);

  double scale() const { return s_.scale; }
  bool dynamic() const { return dynamic_; }

  struct Update {
    bool skip = false;      // the step's update must not be applied
    double attempted = 0;   // the scale the step ran with
    double next = 0;        // the scale of the next step
    int64_t hysteresis = 0; // overflows still tolerated after this one
    std::string message;    // the log line for a skipped step ("" when not skipped)
  };
  // The verdict of one step. An overflow at the minimum scale under dynamic scaling throws
  // Error: the run stops rather than train on what fp16 cannot hold.
  Update update(bool overflow);

  const LossScalerState& state() const { return s_; }
  void restore(const LossScalerState& s) { s_ = s; }

 private:
  bool dynamic_ = false;
  double factor_ = 2.0, min_scale_ = 1.0;
  int64_t window_ = 1000, hysteresis_ = 2;
  bool consecutive_ = false;
  LossScalerState s_;
};

}  // namespace dstrain::runtime
