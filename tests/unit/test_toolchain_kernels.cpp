// The toolchain reproducer (toolchain_case.h, docs/design.md §7.3) compiled with the flags of the
// CPU kernels (-march=DSTRAIN_KERNELS_MARCH, default native: AVX-512 where the machine has it).
#include "tests/unit/toolchain_case.h"

namespace {

TEST(Toolchain, ConstantInt64VectorsKeepTheirElementsWithTheKernelsFlags) {
  expect_constant_int64_vectors_keep_their_elements();
}

}  // namespace
