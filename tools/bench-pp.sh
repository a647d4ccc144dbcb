#!/usr/bin/env bash
# Pipeline-parallel throughput of the `small` preset on this machine: mpirun -np 2 x 1 thread as
# PP = 2 with m = 8 micro-batches of 1 sequence, for each schedule (interleaved with 2 chunks per
# rank), against DP = 2 (ZeRO-2, 4 micro-batches each) on the same global batch. Prints tokens/s
# over steps 41-60, the speed-up over DP 2, the time per step waiting for activations and
# gradients, and the bubble measured in steps 21-60 (1 - busy / span of the busiest rank) next to
# the simulator's prediction for the same schedule with the op costs measured in each step.
# Usage: tools/bench-pp.sh [build-dir]   (about 3 minutes)
source "$(dirname "$0")/bench-common.sh"
common+=(--set train_batch_size=8 --set train_micro_batch_size_per_gpu=1)

mean() {  # mean of a metric over steps 21-60 of the metrics file
  grep -o "\"step\":[0-9]*\|\"$1\":[-0-9.e]*" "$OUT/m.jsonl" |
    awk -F: -v k="\"$1\"" '$1 == "\"step\"" { s = $2 } $1 == k && s > 20 { t += $2; n++ } END { printf "%.1f", n ? 100 * t / n : 0 }'
}
run() {  # prints: tok/s pp_wait_ms
  rm -f "$OUT/m.jsonl"
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root -np 2 --bind-to core "$BIN" "${common[@]}" --threads 1 "$@" 2>&1 |
    grep "step 60/60" | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/; s/,//g' | tr '\n' ' '
  grep -o '"pp_wait_ms":[0-9.e-]*' "$OUT/m.jsonl" | tail -40 | awk -F: '{ t += $2; n++ } END { printf "%.1f\n", n ? t / n : 0 }'
}
printf '%-30s %8s %8s %10s %16s %17s\n' layout tok/s "vs DP 2" pp_wait_ms "measured bubble" "simulated bubble"
read -r base _ < <(run --set zero_optimization.stage=2)
printf '%-30s %8d %7.2fx %10s %16s %17s\n' "DP 2, ZeRO-2" "$base" 1 - - -
for s in gpipe 1f1b interleaved zb-h1; do
  extra=(--set parallel.pipeline=2 --set parallel.pipeline_schedule=$s)
  [ "$s" = interleaved ] && extra+=(--set parallel.virtual_stages=2)
  read -r t w < <(run "${extra[@]}")
  printf '%-30s %8d %7.2fx %10s %15s%% %16s%%\n' "PP 2 $s, m = 8" "$t" "$(calc "$t/$base")" "$w" \
    "$(mean pp_bubble)" "$(mean pp_simulated_bubble)"
done
