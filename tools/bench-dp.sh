#!/usr/bin/env bash
# Data-parallel throughput of the `small` preset on this machine: 1 rank x 1 thread, 1 rank x 2
# threads, and mpirun -np 2 x 1 thread for ZeRO 0 / 1 / 2 with the gradient reduction overlapped
# with backward and not. Prints tokens/s (over steps 41-60), the speed-up over 1 rank x 1 thread,
# the per-step breakdown, the time spent waiting for the gradient reduction after backward, and
# the share of that communication hidden behind the backward pass (1 - wait with overlap / wait
# without). Usage: tools/bench-dp.sh [build-dir]   (about 3 minutes)
source "$(dirname "$0")/bench-common.sh"
common+=(--set monitor.tensorboard="$OUT/tb")


# The last log line's figures: tok/s fwd bwd wait opt
figures() {
  grep "step 60/60" | sed -E 's/.*\| ([0-9,]+) tok\/s.*fwd ([0-9.]+) ms bwd ([0-9.]+) ms comm wait ([0-9.]+) ms opt ([0-9.]+) ms.*/\1 \2 \3 \4 \5/' | tr -d ,
}
one() {  # threads
  OMP_NUM_THREADS=$1 "$BIN" "${common[@]}" --threads "$1" 2>&1 | figures
}
two() {  # zero overlap
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root -np 2 --bind-to core "$BIN" "${common[@]}" --threads 1 \
    --set zero_optimization.stage="$1" --set zero_optimization.overlap_comm="$2" 2>&1 | figures
}

read -r base f b w o < <(one 1)
printf '%-28s %9s %7s %7s %7s %9s %7s %s\n' layout tok/s speedup fwd_ms bwd_ms wait_ms opt_ms
printf '%-28s %9d %7s %7s %7s %9s %7s\n' "1 rank x 1 thread" "$base" "1.00x" "$f" "$b" "-" "$o"
read -r t f b w o < <(one 2)
printf '%-28s %9d %6.2fx %7s %7s %9s %7s\n' "1 rank x 2 threads" "$t" "$(calc "$t/$base")" "$f" "$b" "-" "$o"
for z in 0 1 2; do
  read -r t0 f0 b0 w0 o0 < <(two "$z" false)
  read -r t1 f1 b1 w1 o1 < <(two "$z" true)
  printf '%-28s %9d %6.2fx %7s %7s %9s %7s\n' "2 ranks x 1, ZeRO-$z, no overlap" "$t0" "$(calc "$t0/$base")" "$f0" "$b0" "$w0" "$o0"
  printf '%-28s %9d %6.2fx %7s %7s %9s %7s   hidden %.0f%%, waiting %.1f%% of the step\n' \
    "2 ranks x 1, ZeRO-$z, overlap" "$t1" "$(calc "$t1/$base")" "$f1" "$b1" "$w1" "$o1" \
    "$(calc "100 * (1 - $w1 / $w0)")" "$(calc "100 * $w1 * $t1 / 2048000")"
done
