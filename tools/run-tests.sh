#!/usr/bin/env bash
# The whole test suite from scratch: install missing packages, configure, build, run CTest; then
# the sanitizer and fuzzing stage (tools/run-sanitized.sh: a clang ASan + UBSan build running the
# unit and command-line tests, and each libFuzzer target for a bounded time).
# Extra arguments go to the main ctest (e.g. -L unit, -R Config, --rerun-failed); with extra
# arguments, or DSTRAIN_SANITIZE=0, the sanitizer stage is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default
cmake --build --preset default
ctest --preset default "$@"
if [ $# -eq 0 ] && [ "${DSTRAIN_SANITIZE:-1}" != 0 ]; then
  tools/run-sanitized.sh
fi
