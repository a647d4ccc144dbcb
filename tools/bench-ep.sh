#!/usr/bin/env bash
# Expert-parallel throughput of the `small` preset (32 routed experts) on this machine:
# OMP_NUM_THREADS=1 mpirun -np 2 x 1 thread as EP = 2 against DP = 2, both ZeRO-2. Prints tokens/s
# over steps 41-60, the speed-up over DP 2, the bytes each rank sends per step in the token
# exchanges, the time per step it waits for them (what the shared experts' compute did not
# hide), and the memory per rank the run prints at start.
# Usage: tools/bench-ep.sh [build-dir]   (about 1 minute)
source "$(dirname "$0")/bench-common.sh"
common+=(--set zero_optimization.stage=2)
run() {
  rm -f "$OUT/m.jsonl"
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root -np 2 --bind-to core "$BIN" "${common[@]}" --threads 1 "$@" >"$OUT/log" 2>&1
  grep "step 60/60" "$OUT/log" | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/; s/,//g' | tr '\n' ' '
  { grep -o '"ep_wait_ms":[0-9.e-]*' "$OUT/m.jsonl" || true; } | tail -40 | awk -F: '{ t += $2; n++ } END { printf "%s ", n ? sprintf("%.1f", t / n) : "-" }'
  { grep -o '"ep_bytes":[0-9.e+-]*' "$OUT/m.jsonl" || true; } | tail -1 | awk -F: '{ printf "%.2f", $2 / 1048576 } END { if (NR == 0) printf "-" }'
  echo
  grep -m1 "memory per rank" "$OUT/log" | sed 's/.*memory per rank: /  memory per rank: /' >&2
}
printf '%-18s %8s %8s %14s %16s\n' layout tok/s "vs DP 2" "ep wait ms" "sent MiB/step"
read -r base _ < <(run)
printf '%-18s %8d %7.2fx %14s %16s\n' "DP 2, ZeRO-2" "$base" 1 - -
read -r t w b < <(run --set parallel.expert=2)
printf '%-18s %8d %7.2fx %14s %16s\n' "EP 2, ZeRO-2" "$t" "$(awk "BEGIN { print $t / $base }")" "$w" "$b"
