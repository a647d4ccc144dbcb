// The toolchain compiles what the engine relies on correctly, with the project's own flags.
// GCC 12.2's SLP vectoriser turns some constant int64 vectors into a broadcast of their first
// element — with AVX-512 enabled, and at -march=x86-64-v3 when tuned for Ice Lake or Sapphire
// Rapids (a CI machine's -mtune=native did so). The build therefore turns SLP vectorisation off
// under GCC and tunes generically (CMakeLists.txt, docs/design.md §7.3); this file is compiled
// with the engine's flags and test_toolchain_kernels.cpp with the CPU kernels', so a build option
// that brings the miscompilation back fails here instead of the engine computing nonsense.
#include "tests/unit/toolchain_case.h"

namespace {

TEST(Toolchain, ConstantInt64VectorsKeepTheirElements) { expect_constant_int64_vectors_keep_their_elements(); }

}  // namespace
