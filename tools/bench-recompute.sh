#!/usr/bin/env bash
# Activation checkpointing on this machine: tokens/s, the activations kept for backward (saved)
# and everything the model instances hold with the backward workspace (total, as the run logs it
# after its first step next to the plan's figure), and the process's peak RSS, for the small and
# medium presets with recomputation off, selective and full (fp32 — medium's preset asks for
# bf16, which is not implemented yet — 2 threads, batch 8 x 256 tokens). Step time is the mean
# over the last print window: small steps 21-30, medium steps 4-6.
# Usage: tools/bench-recompute.sh [build-dir] [presets...]   (about 6 minutes for both)
source "$(dirname "$0")/bench-common.sh"
shift || true
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(small medium)
printf '%-8s %-10s %8s %8s %12s %7s %12s %7s %10s\n' preset recompute tok/s "step +%" "saved MiB" "vs off" \
  "total MiB" "vs off" "RSS MiB"
mib() { sed -E 's/([0-9.]+) (KiB|MiB|GiB)/\1 \2/' | awk '{ print ($2 == "GiB" ? $1 * 1024 : $2 == "KiB" ? $1 / 1024 : $1) }'; }
for preset in "${presets[@]}"; do
  if [ "$preset" = medium ]; then steps=6 every=3; else steps=30 every=10; fi
  base=0 base_mem=0 base_saved=0
  for mode in off selective full; do
    args=(configs/$preset.yaml --set train_steps=$steps --set steps_per_print=$every --set data.eval_interval=0
          --set checkpoint.interval=0 --set checkpoint.dir="$OUT/ck" --set checkpoint.resume=none
          --set monitor.expert_stats_interval=0 --set monitor.metrics_file="$OUT/m.jsonl" --threads 2
          --set bf16.enabled=false --set train_batch_size=8 --set train_micro_batch_size_per_gpu=8 --set seq_length=256)
    [ $mode != off ] && args+=(--set activation_checkpointing.enabled=true --set activation_checkpointing.granularity=$mode)
    /usr/bin/time -v "$BIN" "${args[@]}" >"$OUT/log" 2>&1
    tok=$(grep "step $steps/$steps" "$OUT/log" | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/; s/,//g')
    mem=$(grep -m1 "activation memory on rank 0" "$OUT/log" | sed -E 's/.*first step: ([0-9.]+ [KMG]iB).*/\1/' | mib)
    saved=$(grep -m1 "activations per rank:" "$OUT/log" | sed -E 's/.*per rank: ([0-9.]+ [KMG]iB) kept.*/\1/' | mib)
    rss=$(grep "Maximum resident set size" "$OUT/log" | awk '{ printf "%.0f", $NF / 1024 }')
    if [ $mode = off ]; then base=$tok base_mem=$mem base_saved=$saved; fi
    printf '%-8s %-10s %8s %7.1f%% %12.1f %6.2fx %12.1f %6.2fx %10s\n' "$preset" "$mode" "$tok" \
      "$(calc "100 * ($base / $tok - 1)")" "$saved" "$(calc "$base_saved / $saved")" "$mem" \
      "$(calc "$base_mem / $mem")" "$rss"
  done
done
grep -m1 "activation memory on rank 0" "$OUT/log" | sed 's/.*\] /last run: /' >&2
