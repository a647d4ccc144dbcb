#!/usr/bin/env bash
# PowerSGD's validation (issue 45): `small` on 4 data-parallel ranks (mpirun -np 4, ZeRO-1),
# STEPS steps (default 2000, the preset's), uncompressed and with gradient_compression: powersgd
# at rank RANK (default 4) from step START (default 100, the end of the warmup). Prints per run the
# final validation loss (data.eval_iters batches), tokens/s of the last step, and the gradient
# reduction's bytes per step on rank 0 (the comms log's dp + edp all_reduce) — for the compressed
# run those of a compressed step, the uncompressed steps before START taken out — and the ZeRO-1
# parameter all-gather's, which compression leaves as it is.
# Usage: [STEPS=2000] [RANK=4] [START=100] tools/bench-powersgd.sh [build-dir]   (2 x ~15 min on 2 cores)
source "$(dirname "$0")/bench-common.sh"
STEPS=${STEPS:-2000}
RANK=${RANK:-4}
START=${START:-100}
common=(configs/small.yaml --set train_steps="$STEPS" --set steps_per_print=100 --set zero_optimization.stage=1
        --set checkpoint.interval=0 --set checkpoint.save_at_end=false --set checkpoint.dir="$OUT/ck"
        --set checkpoint.resume=none --set monitor.expert_stats_interval=0 --set monitor.comm_log=true)
run() {  # name extra-args... -> "val_loss tok/s reduce_bytes_total allgather_bytes_total"
  local name=$1 log="$OUT/$1.log"
  shift
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 4 "$BIN" "${common[@]}" --threads 1 \
    --set monitor.metrics_file="$OUT/$name.jsonl" "$@" >"$log" 2>&1 || { tail -5 "$log" >&2; exit 1; }
  grep "step $STEPS/$STEPS" "$log" | sed -E 's/.*val_loss ([0-9.]+).*\| ([0-9,]+) tok\/s.*/\1 \2/' | tr -d , | tr '\n' ' '
  python3 -c "
import json
for l in open('$OUT/$name.jsonl'):
    r = json.loads(l)
    if 'comm_log' in r:
        grad = sum(s['bytes'] for s in r['comm_log'] if s['group'] in ('dp', 'edp') and s['op'] == 'all_reduce')
        gather = sum(s['bytes'] for s in r['comm_log'] if s['group'] in ('dp', 'edp') and s['op'] == 'all_gather')
        print(grad, gather)
"
}
read -r v0 t0 g0 a0 < <(run plain)
read -r v1 t1 g1 a1 < <(run powersgd --set gradient_compression.rank="$RANK" --set gradient_compression.start_iter="$START")
python3 - "$STEPS" "$START" "$RANK" "$v0" "$t0" "$g0" "$a0" "$v1" "$t1" "$g1" "$a1" <<'PY'
import sys
steps, start, rank = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
v0, t0, g0, a0, v1, t1, g1, a1 = map(float, sys.argv[4:])
plain_step = g0 / steps
compressed_step = (g1 - start * plain_step) / (steps - start)
mib = 2.0 ** 20
print(f"{'run':<22} {'val loss':>9} {'tok/s':>7} {'grad MiB/step':>14} {'all-gather MiB/step':>20}")
print(f"{'uncompressed':<22} {v0:9.4f} {t0:7.0f} {plain_step / mib:14.3f} {a0 / steps / mib:20.3f}")
print(f"{'powersgd rank ' + rank:<22} {v1:9.4f} {t1:7.0f} {compressed_step / mib:14.3f} {a1 / steps / mib:20.3f}")
print(f"validation loss {100 * (v1 - v0) / v0:+.2f}% against uncompressed; gradient bytes per compressed step "
      f"{plain_step / compressed_step:.1f}x fewer ({steps} steps, compression from step {start})")
PY
