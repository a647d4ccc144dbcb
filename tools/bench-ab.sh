#!/usr/bin/env bash
# Two builds of dstrain side by side on one preset: for each round, each precision, the two
# binaries one after the other (A then B), so that both see the same machine state — tokens/s of
# the last print window, the process's peak RSS (/usr/bin/time -v) and the start-up line of the
# parameters' memory. 2 threads, batch 8 x 256 tokens in one micro-batch, no recomputation.
# Usage: tools/bench-ab.sh BUILD_A BUILD_B [preset] [rounds] [precisions...]
#   e.g. tools/bench-ab.sh /tmp/old/build build medium 2 fp32 bf16   (about 10 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,7p "$0"; exit 2; }
A=$1/bin/dstrain B=$2/bin/dstrain
preset=${3:-medium} rounds=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
precisions=("$@")
[ ${#precisions[@]} -gt 0 ] || precisions=(fp32 bf16)
if [ "$preset" = medium ]; then steps=6 every=3; else steps=30 every=10; fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
printf '%-6s %-5s %-3s %8s %10s  %s\n' round dtype bin tok/s "RSS MiB" "parameters (start-up line)"
for round in $(seq "$rounds"); do
  for dtype in "${precisions[@]}"; do
    for side in A B; do
      bin=$A; [ $side = B ] && bin=$B
      case $dtype in
        fp32) p=(--set bf16.enabled=false --set fp16.enabled=false) ;;
        bf16) p=(--set bf16.enabled=true --set fp16.enabled=false) ;;
        fp16) p=(--set bf16.enabled=false --set fp16.enabled=true) ;;
        *) echo "unknown precision $dtype" >&2; exit 2 ;;
      esac
      /usr/bin/time -v "$bin" "configs/$preset.yaml" --set train_steps=$steps --set steps_per_print=$every \
        --set data.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.save_at_end=false \
        --set checkpoint.dir="$OUT/ck" --set checkpoint.resume=none --set monitor.expert_stats_interval=0 \
        --threads 2 "${p[@]}" --set train_batch_size=8 --set train_micro_batch_size_per_gpu=8 \
        --set seq_length=256 >"$OUT/log" 2>&1
      tok=$(grep "step $steps/$steps" "$OUT/log" | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/; s/,//g')
      rss=$(grep "Maximum resident" "$OUT/log" | awk '{ printf "%.0f", $6 / 1024 }')
      par=$(grep -m1 "memory per rank" "$OUT/log" | sed -E 's/.*memory per rank: parameters ([^,(]+).*/\1/')
      printf '%-6s %-5s %-3s %8s %10s  %s\n' "$round" "$dtype" "$side" "$tok" "$rss" "$par"
    done
  done
done
