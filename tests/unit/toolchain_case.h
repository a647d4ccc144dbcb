// The reproducer of GCC 12.2's SLP miscompilation (docs/design.md §7.3), included by two test
// files: test_toolchain.cpp is compiled with the engine's flags, test_toolchain_kernels.cpp with
// the CPU kernels' (tests/CMakeLists.txt). Everything here has internal linkage, so each file
// keeps the code its own flags produced (an inline function would be merged by the linker).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

__attribute__((noinline)) int64_t sum_weighted(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (size_t i = 0; i < v.size(); ++i) s += int64_t(i + 1) * v[i];
  return s;
}

// With the bug, {5, 5, 0, 0} is built as {5, 5, 5, 5} and {7, 7, 7, 0} as {7, 7, 7, 7}. Flattened:
// the vectors' construction is inlined here, in this file's code, not left to a shared template
// instance the linker could take from the other file.
__attribute__((flatten)) void expect_constant_int64_vectors_keep_their_elements() {
  const std::vector<int64_t> v{5, 5, 0, 0};
  EXPECT_EQ(v[2], 0);
  EXPECT_EQ(v[3], 0);
  EXPECT_EQ(sum_weighted(v), 15);
  const std::vector<int64_t> w{7, 7, 7, 0};
  EXPECT_EQ(sum_weighted(w), 42);
}

}  // namespace
