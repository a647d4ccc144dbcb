#!/usr/bin/env bash
# The whole test suite from scratch: install missing packages, configure, build, run CTest.
# Extra arguments go to ctest (e.g. -L unit, -R Config, --rerun-failed).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default
cmake --build --preset default
ctest --preset default "$@"
