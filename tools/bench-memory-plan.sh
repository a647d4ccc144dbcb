#!/usr/bin/env bash
# The plan against what the ranks hold: for one preset, every precision (fp32, bf16, fp16) x
# activation checkpointing (off, selective, full) x layout (2 ranks: data-parallel 2 at ZeRO 0, 1
# and 2; pipeline 2 with four micro-batches), one step under --memory-breakdown. Prints, per case
# and rank, the plan's total for the rank's stage, the buffers the rank holds after the step, the
# difference, and the process's peak RSS.
# Usage: tools/bench-memory-plan.sh [build-dir] [preset] [seq_length]   (small: about 6 minutes)
# LAYOUTS="dp2-zero2 dp2-zero2-accum4" (environment) runs only those layouts; dp2-zero2-accum4:
# ZeRO-2 with four micro-batches of 2 (every micro-batch reduced, docs/design.md §6.5).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build}/bin/dstrain
preset=${2:-small} seq=${3:-256}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
mib() {  # "12.5 MiB" -> 12.5
  awk '{ v = $1; u = $2; printf "%.1f", u == "GiB" ? v * 1024 : u == "KiB" ? v / 1024 : u == "B" ? v / 1048576 : v }'
}
printf '%-6s %-10s %-12s %5s %11s %11s %8s %10s\n' dtype recompute layout rank "plan MiB" "held MiB" diff "RSS MiB"
for dtype in fp32 bf16 fp16; do
  case $dtype in
    fp32) p=(--set bf16.enabled=false --set fp16.enabled=false) ;;
    bf16) p=(--set bf16.enabled=true --set fp16.enabled=false) ;;
    fp16) p=(--set bf16.enabled=false --set fp16.enabled=true) ;;
  esac
  for mode in off selective full; do
    ac=()
    [ $mode != off ] && ac=(--set activation_checkpointing.enabled=true --set activation_checkpointing.granularity=$mode)
    for layout in ${LAYOUTS:-dp2-zero0 dp2-zero1 dp2-zero2 pp2}; do
      case $layout in
        dp2-zero2-accum4) l=(--set parallel.pipeline=1 --set zero_optimization.stage=2
                             --set train_batch_size=16 --set train_micro_batch_size_per_gpu=2) ;;
        dp2-zero*) l=(--set parallel.pipeline=1 --set zero_optimization.stage=${layout#dp2-zero}
                      --set train_batch_size=16 --set train_micro_batch_size_per_gpu=8) ;;
        pp2) l=(--set parallel.pipeline=2 --set train_batch_size=8 --set train_micro_batch_size_per_gpu=2) ;;
      esac
      mpirun --oversubscribe --allow-run-as-root -np 2 "$BIN" "configs/$preset.yaml" --resume none \
        --set seq_length="$seq" --set checkpoint.dir="$OUT/ck" --threads 1 "${p[@]}" "${ac[@]}" "${l[@]}" \
        --memory-breakdown >"$OUT/log" 2>&1 || { echo "$dtype $mode $layout: failed"; tail -3 "$OUT/log"; continue; }
      total=$(grep -E "^total +\|" "$OUT/log" | head -1)
      rss=$(grep -E "^process peak RSS" "$OUT/log" | head -1)
      for rank in 0 1; do
        plan=$(echo "$total" | awk -F'|' -v r=$((rank + 2)) '{ print $r }' | awk '{ print $1, $2 }' | mib)
        held=$(echo "$total" | awk -F'|' -v r=$((rank + 2)) '{ print $r }' | awk '{ print $3, $4 }' | mib)
        peak=$(echo "$rss" | awk -F'|' -v r=$((rank + 2)) '{ print $r }' | awk '{ print $1, $2 }' | mib)
        diff=$(awk -v a="$held" -v b="$plan" 'BEGIN { printf "%+.1f%%", 100 * (a - b) / b }')
        printf '%-6s %-10s %-12s %5s %11s %11s %8s %10s\n' $dtype $mode $layout $rank "$plan" "$held" "$diff" "$peak"
      done
    done
  done
done
