#!/usr/bin/env bash
# Tensor-parallel throughput of the `small` preset on this machine: 1 rank x 1 thread against
# mpirun -np 2 x 1 thread as TP = 2 (with and without sequence parallelism) and as DP = 2
# (ZeRO-2). Prints tokens/s over steps 41-60, the speed-up over 1 rank x 1 thread, the step
# breakdown, the time per step inside the tensor-parallel collectives (including waiting for
# the other rank), and the per-rank memory the run prints at start.
# Usage: tools/bench-tp.sh [build-dir]   (about 3 minutes)
source "$(dirname "$0")/bench-common.sh"


# tok/s fwd bwd opt tp_comm | memory line | activations line
figures() {
  local log; log=$(cat)
  echo "$log" | grep "step 60/60" |
    sed -E 's/.*\| ([0-9,]+) tok\/s.*fwd ([0-9.]+) ms bwd ([0-9.]+) ms comm wait [0-9.]+ ms opt ([0-9.]+) ms( tp comm ([0-9.]+) ms)?.*/\1 \2 \3 \4 \6/' | tr -d ,
  echo "$log" | grep -m1 "memory per rank" | sed 's/.*memory per rank: //' >&2
  echo "$log" | grep -m1 "activations per rank" | sed 's/.*activations per rank: /  activations: /' >&2
}
one() { OMP_NUM_THREADS=1 "$BIN" "${common[@]}" --threads 1 2>&1 | figures; }
two() { OMP_NUM_THREADS=1 mpirun --allow-run-as-root -np 2 --bind-to core "$BIN" "${common[@]}" --threads 1 "$@" 2>&1 | figures; }

row() {  # name tok fwd bwd opt tp
  printf '%-34s %9d %6.2fx %7s %7s %7s %9s\n' "$1" "$2" "$(calc "$2/$base")" "$3" "$4" "$5" "${6:--}"
}
printf '%-34s %9s %7s %7s %7s %7s %9s\n' layout tok/s speedup fwd_ms bwd_ms opt_ms tp_comm_ms
read -r base f b o tp < <(one)
row "1 rank x 1 thread" "$base" "$f" "$b" "$o"
read -r t f b o tp < <(two --set parallel.tensor=2)
row "TP 2 x 1 thread" "$t" "$f" "$b" "$o" "$tp"
read -r t f b o tp < <(two --set parallel.tensor=2 --set parallel.sequence_parallel=true)
row "TP 2 x 1 thread, sequence parallel" "$t" "$f" "$b" "$o" "$tp"
read -r t f b o tp < <(two --set zero_optimization.stage=2)
row "DP 2 x 1 thread, ZeRO-2" "$t" "$f" "$b" "$o"
