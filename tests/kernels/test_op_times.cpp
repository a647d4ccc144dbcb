// Per-op timing (Backend::set_op_timing / take_op_times, monitor.op_breakdown; docs/design.md
// §6.12): the CPU backend counts each op once under its own name — also an op that calls others
// from its worker threads (gemm_grouped) — nothing while off, and the device-memory check backend
// reports its inner backend's times.
#include <gtest/gtest.h>

#include <map>
#include <thread>
#include <vector>

#include "dstrain/kernels/backend.h"
#include "dstrain/kernels/op_times.h"

namespace dstrain::kernels {
namespace {

std::map<std::string, OpTime> by_name(const std::vector<OpTime>& v) {
  std::map<std::string, OpTime> m;
  for (const OpTime& t : v) m[t.op] = t;
  return m;
}

TEST(OpTimes, EachOpCountsOnceUnderItsOwnNameAndNothingWhileOff) {
  for (const bool checked : {false, true}) {
    std::unique_ptr<Backend> be = make_cpu_backend(2);
    if (checked) be = make_device_check_backend(std::move(be));
    EXPECT_EQ(be->op_timing_clock(), "the host clock");
    const int64_t n = 64;
    float* a = static_cast<float*>(be->allocate(n * n * 4));
    float* b = static_cast<float*>(be->allocate(n * n * 4));
    float* c = static_cast<float*>(be->allocate(n * n * 4));
    be->fill({a, {n * n}}, 1.0f);
    be->fill({b, {n * n}}, 2.0f);
    be->gemm({c, {n, n}}, {a, {n, n}}, {b, {n, n}}, false, false, 1.0f, 0.0f);
    EXPECT_TRUE(be->take_op_times().empty()) << "timed while off";
    be->set_op_timing(true);
    for (int i = 0; i < 3; ++i) be->gemm({c, {n, n}}, {a, {n, n}}, {b, {n, n}}, false, false, 1.0f, 0.0f);
    be->fill({c, {n * n}}, 0.0f);
    // 16 problems on 2 threads: gemm_grouped runs gemm on its worker threads.
    std::vector<float*> C(16, c);
    std::vector<const void*> A(16, a), B(16, b);
    std::vector<int64_t> M(16, 8), N(16, 8), K(16, n);
    be->gemm_grouped(gemm_problems(C.data(), A.data(), B.data(), DType::kF32, M.data(), N.data(), K.data(), 16, false, false), false, false, 1.0f, 0.0f);
    const std::vector<OpTime> got = be->take_op_times();
    be->set_op_timing(false);
    const auto m = by_name(got);
    ASSERT_EQ(m.size(), 3u) << "gemm, fill, gemm_grouped and nothing else";
    EXPECT_EQ(m.at("gemm").calls, 3) << "the grouped product's gemms are its own";
    EXPECT_EQ(m.at("fill").calls, 1);
    EXPECT_EQ(m.at("gemm_grouped").calls, 1);
    for (const OpTime& t : got) EXPECT_GE(t.ms, 0.0) << t.op;
    for (size_t i = 1; i < got.size(); ++i) EXPECT_GE(got[i - 1].ms, got[i].ms) << "largest first";
    EXPECT_TRUE(be->take_op_times().empty()) << "take clears";
    be->deallocate(a), be->deallocate(b), be->deallocate(c);
  }
}

TEST(OpTimes, ScopesOpenAtOnceCountOnceAndNeverTheSameTimeTwice) {
  HostOpTimes t;
  {
    const HostOpTimes::Scope off(t, "before");  // opened while off: never counts
    t.set(true);
  }
  {
    const HostOpTimes::Scope outer(t, "outer");
    const HostOpTimes::Scope inner(t, "inner");
    std::thread other([&] { const HostOpTimes::Scope beside(t, "beside"); });
    other.join();
  }
  { const HostOpTimes::Scope alone(t, "beside"); }
  const auto m = by_name(t.take());
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m.at("outer").calls, 1);
  EXPECT_EQ(m.at("beside").calls, 1) << "the one opened alone";
}

}  // namespace
}  // namespace dstrain::kernels
