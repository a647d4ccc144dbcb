// The toolchain compiles what the engine relies on correctly, with the project's own flags.
// GCC 12.2 with AVX-512 enabled (-march=native on Zen 4 or Sapphire Rapids, -mavx512f)
// vectorises the constant int64 vector below into a broadcast of its first element; the engine
// is therefore built for x86-64-v3 (CMakeLists.txt, docs/design.md §7.3), and this test is
// compiled with the engine's flags: if a build option brings the miscompilation back, it fails
// instead of the engine silently computing nonsense. (The CPU kernels keep AVX-512 without SLP
// vectorisation, and their own tests check them against naive references.)
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace {

__attribute__((noinline)) int64_t sum_weighted(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (size_t i = 0; i < v.size(); ++i) s += int64_t(i + 1) * v[i];
  return s;
}

TEST(Toolchain, ConstantInt64VectorsKeepTheirElements) {
  const std::vector<int64_t> v{5, 5, 0, 0};
  EXPECT_EQ(v[2], 0);
  EXPECT_EQ(v[3], 0);
  EXPECT_EQ(sum_weighted(v), 15);
  const std::vector<int64_t> w{7, 7, 7, 0};
  EXPECT_EQ(sum_weighted(w), 42);
}

}  // namespace
