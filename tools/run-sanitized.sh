#!/usr/bin/env bash
# The sanitizer and fuzzing part of the test suite (tools/run-tests.sh calls it after the main
# suite): a clang build with AddressSanitizer and UndefinedBehaviorSanitizer (CMake preset
# `sanitize`, build-sanitize/), the unit and command-line tests run on it (a few of the longest
# left out, they run in the main suite), then each libFuzzer target of tests/fuzz for
# DSTRAIN_FUZZ_SECONDS (default 12) seconds from its seed corpus in tests/fuzz/corpus/. Any
# sanitizer report or fuzzer crash fails it. Extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset sanitize >/dev/null
# Only what the stage runs: the unit and command-line test binaries, the executables test_cli
# starts, and the fuzz targets (the kernel / model / MPI test binaries run in the main suite).
cmake --build --preset sanitize --target test_unit test_cli dstrain dstrain-ckpt dstrain-prep dstrain-bench dstrain-report \
  fuzz_config fuzz_tokenizer fuzz_checkpoint fuzz_safetensors
ctest --preset sanitize "$@"
seconds=${DSTRAIN_FUZZ_SECONDS:-12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
crashes=build-sanitize/fuzz-crashes  # inputs that made a target fail are kept here
mkdir -p "$crashes"
for target in config tokenizer checkpoint safetensors; do
  mkdir -p "$work/$target"  # new inputs go here; the committed seed corpus stays as it is
  echo "fuzz_$target: ${seconds} s"
  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    build-sanitize/bin/fuzz_$target "$work/$target" "tests/fuzz/corpus/$target" \
      -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$crashes/$target-" 2>"$work/$target.log" || {
    tail -40 "$work/$target.log"
    for f in "$crashes/$target"-*; do [ -e "$f" ] && echo "input kept: $f; replay: build-sanitize/bin/fuzz_$target $f"; done
    echo "fuzz_$target found a failure (log above)" >&2
    exit 1
  }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$work/$target.log" | sed "s/^/  /"
done
echo "sanitizers and fuzzers: ok"
