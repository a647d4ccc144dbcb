// fp16 loss scaling against DeepSpeed's rules (engine/runtime/loss_scaler.h): the scale doubles
// after `loss_scale_window` clean steps strictly after the last overflow; an overflow spends one
// unit of hysteresis, and once none is left halves the scale (not below min_loss_scale) without
// refilling it; clean steps refill it at the next doubling, or at once with
// consecutive_hysteresis; an overflow at the minimum scale stops the run; a static scale only
// skips. The sequences were worked out by hand from those rules.
#include <gtest/gtest.h>

#include <vector>

#include "engine/common/error.h"
#include "engine/runtime/loss_scaler.h"

namespace dstrain::runtime {
namespace {

config::Fp16Config fp16(int64_t power, int64_t window, int64_t hysteresis, bool consecutive, double min_scale = 1) {
  config::Fp16Config c;
  c.enabled = true, c.initial_scale_power = power, c.loss_scale_window = window, c.hysteresis = hysteresis;
  c.consecutive_hysteresis = consecutive, c.min_loss_scale = min_scale;
  return c;
}

struct Expect {
  bool overflow;
  double next;
  int64_t hysteresis;
};

void run(LossScaler& s, const std::vector<Expect>& steps, const char* what) {
  int i = 0;
  for (const Expect& e : steps) {
    const double before = s.scale();
    const LossScaler::Update u = s.update(e.overflow);
    EXPECT_EQ(u.skip, e.overflow) << what << " step " << i;
    EXPECT_EQ(u.attempted, before) << what << " step " << i;
    EXPECT_EQ(u.next, e.next) << what << " step " << i;
    EXPECT_EQ(s.scale(), e.next) << what << " step " << i;
    EXPECT_EQ(u.hysteresis, e.hysteresis) << what << " step " << i;
    EXPECT_EQ(u.message.empty(), !e.overflow) << what << " step " << i;
    ++i;
  }
}

TEST(LossScaler, WindowAndHysteresis) {
  LossScaler s(fp16(4, 3, 2, false));
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 16.0);
  run(s,
      {{false, 16, 2}, {false, 16, 2}, {false, 16, 2},
       {false, 32, 2},   // three clean steps before this one: double
       {true, 32, 1},    // tolerated
       {true, 16, 1},    // no tolerance left: halve
       {true, 8, 1},     // and again (halving does not refill)
       {false, 8, 1}, {false, 8, 1}, {false, 8, 1},
       {false, 16, 2},   // three clean steps since the overflow before this one: double, refill
       {true, 16, 1}, {false, 16, 1},
       {true, 8, 1}},    // the clean step in between did not refill
      "window 3, hysteresis 2");
  EXPECT_EQ(s.state().skipped, 5);
  EXPECT_EQ(s.state().iter, 14);
  EXPECT_EQ(s.state().last_overflow_iter, 13);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  LossScaler s(fp16(4, 3, 2, true));
  run(s, {{true, 16, 1}, {false, 16, 2}, {true, 16, 1}, {false, 16, 2}, {true, 16, 1}, {true, 8, 1}, {false, 8, 2}},
      "consecutive");
}

TEST(LossScaler, HysteresisOfOneHalvesAtOnceAndTheMinimumStopsTheRun) {
  LossScaler s(fp16(3, 1000, 1, false, 4.0));
  run(s, {{true, 4, 1}}, "min 4");
  try {
    s.update(true);
    ADD_FAILURE() << "an overflow at the minimum scale was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("minimum loss scale 4 (fp16.min_loss_scale)"), std::string::npos) << e.what();
  }
  // Between the minimum and twice it, halving stops at the minimum.
  LossScaler t(fp16(3, 1000, 1, false, 5.0));
  run(t, {{true, 5, 1}}, "min 5");
}

TEST(LossScaler, StaticScaleOnlySkips) {
  config::Fp16Config c = fp16(16, 2, 2, false);
  c.loss_scale = 128;
  LossScaler s(c);
  EXPECT_FALSE(s.dynamic());
  run(s, {{false, 128, 2}, {false, 128, 2}, {false, 128, 2}, {true, 128, 2}, {true, 128, 2}}, "static");
  EXPECT_EQ(s.state().skipped, 2);
}

// The state a checkpoint keeps continues the sequence exactly.
TEST(LossScaler, RestoredStateContinuesTheSequence) {
  const std::vector<bool> flags = {false, true, false, false, true, true, false, false, false, false, true, false};
  LossScaler a(fp16(5, 2, 2, false));
  std::vector<double> straight;
  for (bool f : flags) straight.push_back(a.update(f).next);
  LossScaler b(fp16(5, 2, 2, false));
  for (size_t i = 0; i < 6; ++i) b.update(flags[i]);
  LossScaler c(fp16(5, 2, 2, false));
  c.restore(b.state());
  for (size_t i = 6; i < flags.size(); ++i) EXPECT_EQ(c.update(flags[i]).next, straight[i]) << i;
}

}  // namespace
}  // namespace dstrain::runtime
