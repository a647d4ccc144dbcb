#!/usr/bin/env bash
# Precision x activation checkpointing on this machine: for the small and medium presets, fp32,
# bf16 and fp16 each with recomputation off, selective and full — tokens/s, the speed-up over
# fp32 with the same recomputation, the step-time cost of recomputation, the activations kept for
# backward (saved) and everything the model instances hold with the backward workspace (total, as
# the run logs it after its first step), and the process's peak RSS. 2 threads, batch 8 x 256
# tokens (one micro-batch per step). Step time is the mean over the last print window: small
# steps 21-30, medium steps 4-6. Then medium at the preset's sequence length (2 x 2048 tokens,
# fp32 and bf16, no recomputation), where attention weighs more.
# Usage: tools/bench-precision.sh [build-dir] [presets...]   (about 20 minutes for both)
source "$(dirname "$0")/bench-common.sh"
shift || true
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(small medium)
printf '%-8s %-5s %-10s %8s %8s %8s %10s %7s %10s %7s %9s\n' preset dtype recompute tok/s "vs fp32" "step +%" \
  "saved MiB" "vs off" "total MiB" "vs off" "RSS MiB"
mib() { sed -E 's/([0-9.]+) (KiB|MiB|GiB)/\1 \2/' | awk '{ print ($2 == "GiB" ? $1 * 1024 : $2 == "KiB" ? $1 / 1024 : $1) }'; }
tokens() { grep "step $1/$1" "$OUT/log" | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/; s/,//g'; }
precision_args() {
  case $1 in
    fp32) echo "--set bf16.enabled=false --set fp16.enabled=false" ;;
    bf16) echo "--set bf16.enabled=true --set fp16.enabled=false" ;;
    fp16) echo "--set bf16.enabled=false --set fp16.enabled=true" ;;
  esac
}
declare -A fp32_tok
for preset in "${presets[@]}"; do
  if [ "$preset" = medium ]; then steps=6 every=3; else steps=30 every=10; fi
  for dtype in fp32 bf16 fp16; do
    base=0 base_mem=0 base_saved=0
    for mode in off selective full; do
      # shellcheck disable=SC2046
      args=(configs/$preset.yaml --set train_steps=$steps --set steps_per_print=$every --set data.eval_interval=0
            --set checkpoint.interval=0 --set checkpoint.dir="$OUT/ck" --set checkpoint.resume=none
            --set monitor.expert_stats_interval=0 --set monitor.metrics_file="$OUT/m.jsonl" --threads 2
            $(precision_args $dtype) --set train_batch_size=8 --set train_micro_batch_size_per_gpu=8
            --set seq_length=256)
      [ $mode != off ] && args+=(--set activation_checkpointing.enabled=true --set activation_checkpointing.granularity=$mode)
      /usr/bin/time -v "$BIN" "${args[@]}" >"$OUT/log" 2>&1
      tok=$(tokens $steps)
      mem=$(grep -m1 "activation memory on rank 0" "$OUT/log" | sed -E 's/.*first step: ([0-9.]+ [KMG]iB).*/\1/' | mib)
      saved=$(grep -m1 "activations per rank:" "$OUT/log" | sed -E 's/.*per rank: ([0-9.]+ [KMG]iB) kept.*/\1/' | mib)
      rss=$(grep "Maximum resident set size" "$OUT/log" | awk '{ printf "%.0f", $NF / 1024 }')
      if [ $mode = off ]; then base=$tok base_mem=$mem base_saved=$saved; fi
      [ $dtype = fp32 ] && fp32_tok[$preset$mode]=$tok
      printf '%-8s %-5s %-10s %8s %7.2fx %7.1f%% %10.1f %6.2fx %10.1f %6.2fx %9s\n' "$preset" $dtype "$mode" "$tok" \
        "$(calc "$tok / ${fp32_tok[$preset$mode]}")" "$(calc "100 * ($base / $tok - 1)")" "$saved" \
        "$(calc "$base_saved / $saved")" "$mem" "$(calc "$base_mem / $mem")" "$rss"
    done
  done
done
grep -m1 "GEMMs" "$OUT/log" | sed -E 's/.*GEMMs ([^)]*\)).*/low-precision GEMMs: \1/' >&2 || true
for preset in "${presets[@]}"; do
  [ "$preset" = medium ] || continue
  for dtype in fp32 bf16; do
    # shellcheck disable=SC2046
    "$BIN" configs/medium.yaml --set train_steps=4 --set steps_per_print=2 --set data.eval_interval=0 \
      --set checkpoint.interval=0 --set checkpoint.dir="$OUT/ck" --set checkpoint.resume=none \
      --set monitor.expert_stats_interval=0 --threads 2 $(precision_args $dtype) --set train_batch_size=2 \
      --set train_micro_batch_size_per_gpu=2 --set seq_length=2048 >"$OUT/log" 2>&1
    tok=$(tokens 4)
    [ $dtype = fp32 ] && long=$tok
    printf 'medium %s, 2 x 2048 tokens, steps 3-4: %s tok/s (%.2fx fp32)\n' $dtype "$tok" "$(calc "$tok / $long")"
  done
done
