#!/usr/bin/env bash
# Gradient messages in fp32 against 16 bits (communication_data_type: bf16): `medium` under bf16
# (4 x 256 tokens per rank and step) on mpirun -np 2 x 1 thread, ZeRO-1 (ZERO=2: ZeRO-2), the two
# run alternately ROUNDS times. Prints
# per run tokens/s, the step's wait for the gradient reduction after backward, and the bytes the
# comms log counted for the dp group's reduction per step (rank 0).
# Usage: [ZERO=1|2] tools/bench-comm-dtype.sh [build-dir] [rounds]   (2-5 minutes per round)
source "$(dirname "$0")/bench-common.sh"
ROUNDS=${2:-2}
STEPS=6
common=(configs/medium.yaml --set seq_length=256 --set train_batch_size=8 --set train_micro_batch_size_per_gpu=4
        --set train_steps=$STEPS --set steps_per_print=$STEPS --set data.eval_interval=0
        --set checkpoint.interval=0 --set checkpoint.save_at_end=false --set checkpoint.dir="$OUT/ck"
        --set checkpoint.resume=none --set wall_clock_breakdown=true --set monitor.expert_stats_interval=0
        --set bf16.enabled=true --set monitor.comm_log=true)
run() {  # zero comm-dtype -> "tok/s wait_ms bytes_per_step"
  local log="$OUT/log"
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root -np 2 --bind-to core "$BIN" "${common[@]}" --threads 1 \
    --set zero_optimization.stage="$1" --set communication_data_type="$2" \
    --set monitor.metrics_file="$OUT/m.jsonl" >"$log" 2>&1
  local tok wait bytes
  tok=$(grep "step $STEPS/$STEPS" "$log" | sed -E 's/.*\| ([0-9,]+) tok\/s.*/\1/' | tr -d ,)
  wait=$(grep "step $STEPS/$STEPS" "$log" | sed -E 's/.*comm wait ([0-9.]+) ms.*/\1/')
  bytes=$(python3 -c "
import json
for l in open('$OUT/m.jsonl'):
    r = json.loads(l)
    if 'comm_log' in r:
        b = sum(s['bytes'] for s in r['comm_log'] if s['group'] == 'dp' and s['op'] in ('all_reduce', 'reduce_scatter'))
        print(f'{b / $STEPS / 2**20:.1f}')
")
  rm -f "$OUT/m.jsonl"
  echo "$tok $wait $bytes"
}
printf '%-6s %-8s %-6s %9s %9s %16s\n' ZeRO messages round tok/s wait_ms "MiB/step (dp)"
for z in ${ZERO:-1}; do
  for r in $(seq "$ROUNDS"); do
    for dt in fp32 bf16; do
      read -r t w b < <(run "$z" "$dt")
      printf '%-6s %-8s %-6s %9s %9s %16s\n' "$z" "$dt" "$r" "$t" "$w" "$b"
    done
  done
done
