// DSTRAIN_FAULT_INJECT, parsed in one place: kinds and counts, several at once, and malformed
// values refused with a message (a test must not pass by injecting nothing).
#include <gtest/gtest.h>

#include "engine/common/error.h"
#include "engine/common/fault_inject.h"

namespace dstrain {
namespace {

TEST(FaultInject, KindsAndCounts) {
  EXPECT_EQ(parse_fault("skip_grad_sync:3", Fault::kSkipGradSync), 3);
  EXPECT_EQ(parse_fault("skip_grad_sync:3", Fault::kCrashDuringSave), 0);
  EXPECT_EQ(parse_fault("crash_during_save:2,skip_grad_sync:7", Fault::kCrashDuringSave), 2);
  EXPECT_EQ(parse_fault("crash_during_save:2,skip_grad_sync:7", Fault::kSkipGradSync), 7);
  EXPECT_EQ(parse_fault("", Fault::kSkipGradSync), 0);
}

TEST(FaultInject, MalformedValuesAreErrors) {
  for (const char* bad : {"skip_grad_sync", "skip_grad_sync:", "skip_grad_sync:x", "skip_grad_sync:0",
                          "skip_grad_sync:-1", "crash_during_save:2x", "crash:1"}) {
    try {
      parse_fault(bad, Fault::kSkipGradSync);
      ADD_FAILURE() << bad << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("DSTRAIN_FAULT_INJECT"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("valid: skip_grad_sync:N, crash_during_save:N, slow_save:N"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace dstrain
