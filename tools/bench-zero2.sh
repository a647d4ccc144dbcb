#!/usr/bin/env bash
# ZeRO-2 holding its gradient shard (docs/design.md §6.5) against another build: the `small`
# preset on 2 ranks x 1 thread, ZeRO-2 with overlap, batch 8 x 256 tokens as one micro-batch per
# rank and as four (every micro-batch reduced), the two builds alternately for each round.
# Prints tokens/s over steps 41-60, the wait for the gradient reduction per step, and rank 0's
# gradients planned / held and its peak RSS from the memory breakdown after step 1.
# Usage: tools/bench-zero2.sh BUILD_A BUILD_B [rounds]   (about 2 minutes a round)
source "$(dirname "$0")/bench-common.sh"
[ $# -ge 2 ] || { sed -n 2,7p "$0"; exit 2; }
A=$1/bin/dstrain B=$2/bin/dstrain rounds=${3:-2}
printf '%-5s %-14s %-3s %8s %8s %22s %10s\n' round micro-batches bin tok/s wait_ms "gradients plan / held" "RSS r0"
for round in $(seq "$rounds"); do
  for micro in ${MICROS:-4 1}; do
    for side in A B; do
      bin=$A; [ $side = B ] && bin=$B
      OMP_NUM_THREADS=1 mpirun --allow-run-as-root -np 2 --bind-to core "$bin" "${common[@]}" --threads 1 \
        --set zero_optimization.stage=2 --set train_batch_size=8 --set train_micro_batch_size_per_gpu="$micro" \
        >"$OUT/log" 2>&1
      read -r tok wait < <(grep "step 60/60" "$OUT/log" |
        sed -E 's/.*\| ([0-9,]+) tok\/s.*comm wait ([0-9.]+) ms.*/\1 \2/' | tr -d ,)
      grads=$(grep -E "^gradients +\|" "$OUT/log" | awk -F'|' '{ print $2 }' | awk '{ print $1 $2 " / " $3 $4 }')
      rss=$(grep -E "^process peak RSS" "$OUT/log" | awk -F'|' '{ print $2 }' | awk '{ print $1 $2 }')
      printf '%-5s %-14s %-3s %8s %8s %22s %10s\n' "$round" "$((4 / micro)) per rank" "$side" "$tok" "$wait" \
        "$grads" "$rss"
    done
  done
done
