// Pipeline schedules (engine/plan/pipeline_schedule.h): every generated schedule is valid for
// p = 1..8 ranks and m = 1..16 micro-batches (v = 1, 2, 3 chunks for the interleaved one), its bubble
// at unit costs equals the closed form — (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1)
// interleaved — and ZB-H1's is a third of 1F1B's; the simulator catches broken lists.
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/plan/pipeline_schedule.h"

namespace dstrain::plan {
namespace {

using Kind = config::PipelineScheduleKind;

TEST(PipelineSchedule, EveryScheduleIsValidAndMeetsItsClosedForm) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE(::testing::Message() << "p " << p << " m " << m);
      const Simulation gpipe = simulate(make_schedule(Kind::kGpipe, p, m));
      const Simulation ofob = simulate(make_schedule(Kind::kOneFOneB, p, m));
      const Simulation zb = simulate(make_schedule(Kind::kZbH1, p, m));
      ASSERT_EQ(gpipe.error, "");
      ASSERT_EQ(ofob.error, "");
      ASSERT_EQ(zb.error, "");
      const double closed = double(p - 1) / double(m + p - 1);
      EXPECT_NEAR(gpipe.stats.bubble, closed, 1e-12);
      EXPECT_NEAR(ofob.stats.bubble, closed, 1e-12);
      // Unit costs: F = B = W = 1. 1F1B idles (p−1)(F+B+W); ZB-H1 (p−1)(F+B−W) once m >= p.
      const double idle_1f1b = ofob.stats.step_time - ofob.stats.compute;
      const double idle_zb = zb.stats.step_time - zb.stats.compute;
      EXPECT_DOUBLE_EQ(idle_1f1b, 3.0 * (p - 1));
      if (m >= p) {
        EXPECT_DOUBLE_EQ(idle_zb, double(p - 1)) << "ZB-H1 bubble time";
      }
      EXPECT_LE(idle_zb, idle_1f1b);
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(gpipe.stats.peak_in_flight[size_t(r)], m);
        EXPECT_EQ(ofob.stats.peak_in_flight[size_t(r)], std::min(p - r, m)) << "rank " << r;
        EXPECT_LE(zb.stats.peak_in_flight[size_t(r)], std::min(p, m)) << "ZB-H1 holds no more than 1F1B's peak";
      }
      if (m % p == 0)
        for (const int v : {1, 2, 3}) {
          const Simulation il = simulate(make_schedule(Kind::kInterleaved, p, m, v));
          ASSERT_EQ(il.error, "") << "v " << v;
          EXPECT_NEAR(il.stats.bubble, double(p - 1) / double(v * m + p - 1), 1e-12) << "v " << v;
        }
    }
}

TEST(PipelineSchedule, RefusesWhatItCannotRun) {
  EXPECT_NE(schedule_refusal(Kind::kInterleaved, 4, 6, 2).find("must be a multiple of parallel.pipeline = 4"),
            std::string::npos);
  EXPECT_NE(schedule_refusal(Kind::kInterleaved, 4, 2, 2), "");
  EXPECT_NE(schedule_refusal(Kind::kOneFOneB, 2, 4, 2).find("need the interleaved schedule"), std::string::npos);
  EXPECT_EQ(schedule_refusal(Kind::kOneFOneB, 4, 2, 1), "");  // fewer micro-batches than stages: a bigger bubble
  EXPECT_THROW(make_schedule(Kind::kInterleaved, 4, 6, 2), std::invalid_argument);
}

TEST(PipelineSchedule, SimulatorCatchesBrokenLists) {
  PipelineSchedule s = make_schedule(Kind::kOneFOneB, 2, 4);
  {  // two receives swapped: the messages arrive in another order
    PipelineSchedule t = s;
    auto& l = t.ranks[1];
    std::vector<size_t> recvs;
    for (size_t i = 0; i < l.size(); ++i)
      if (l[i].op == PipeOp::kRecvActivation) recvs.push_back(i);
    std::swap(l[recvs[0]].micro, l[recvs[1]].micro);
    EXPECT_NE(simulate(t).error.find("expected micro-batch"), std::string::npos) << simulate(t).error;
  }
  {  // the last send dropped: its receiver waits forever, and so does the rank waiting for it
    PipelineSchedule t = s;
    auto& l = t.ranks[0];
    const auto last = std::find_if(l.rbegin(), l.rend(), [](const PipeInstr& i) { return i.op == PipeOp::kSendActivation; });
    l.erase(std::next(last).base());
    EXPECT_NE(simulate(t).error.find("deadlock: rank 0 waits at instruction"), std::string::npos) << simulate(t).error;
  }
  {  // a send without its receive
    PipelineSchedule t = s;
    auto& l = t.ranks[1];
    l.erase(std::find_if(l.begin(), l.end(), [](const PipeInstr& i) { return i.op == PipeOp::kRecvActivation; }));
    EXPECT_NE(simulate(t).error, "");
  }
  {  // a backward moved before its forward
    PipelineSchedule t = make_schedule(Kind::kGpipe, 1, 2);
    std::swap(t.ranks[0][0], t.ranks[0][2]);
    EXPECT_NE(simulate(t).error.find("backward before its forward"), std::string::npos) << simulate(t).error;
  }
  {  // a W before its B
    PipelineSchedule t = make_schedule(Kind::kZbH1, 1, 1);
    std::swap(t.ranks[0][1], t.ranks[0][2]);
    EXPECT_NE(simulate(t).error.find("weight gradients before the input gradient"), std::string::npos)
        << simulate(t).error;
  }
}

TEST(PipelineSchedule, TextShowsEachRanksOrder) {
  const std::string t = schedule_text(make_schedule(Kind::kOneFOneB, 2, 3));
  EXPECT_NE(t.find("  rank 0: F0 F1 B0 F2 B1 B2\n"), std::string::npos) << t;
  EXPECT_NE(t.find("  rank 1: F0 B0 F1 B1 F2 B2\n"), std::string::npos) << t;
  const std::string il = schedule_text(make_schedule(Kind::kInterleaved, 2, 2, 2));
  EXPECT_NE(il.find("F0.0 F1.0 F0.1 F1.1"), std::string::npos) << il;
}

}  // namespace
}  // namespace dstrain::plan
