#!/usr/bin/env bash
# Two builds bit for bit (a refactor that must not change the numbers): `tiny`'s --dump-grads
# files in fp32, bf16, fp16 and with V2 softmax / greedy routing, and the losses and gradient
# norms of 8 steps of `small` on one rank and on DP 2 at ZeRO-1 (which run AdamW).
# Usage: tools/compare-builds.sh OLD_BUILD NEW_BUILD   (about a minute)
set -u
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { sed -n 2,5p "$0"; exit 2; }
A=$1/bin/dstrain B=$2/bin/dstrain
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
for v in "fp32:" "bf16:--set bf16.enabled=true" "fp16:--set fp16.enabled=true" "v2:--set model.model_type=deepseek_v2 --set model.scoring_func=softmax --set model.topk_method=greedy --set model.n_group=1 --set model.topk_group=1"; do
  name=${v%%:*}; extra=${v#*:}
  for side in A B; do bin=$A; [ $side = B ] && bin=$B
    $bin configs/tiny.yaml --resume none --set checkpoint.dir=$D/ck --dump-grads $D/${name}_$side.h5 $extra >/dev/null 2>&1 || echo "$name $side failed"
  done
  if h5diff -q $D/${name}_A.h5 $D/${name}_B.h5 >/dev/null 2>&1; then echo "dump-grads $name: identical"; else echo "dump-grads $name: DIFFERENT"; h5diff $D/${name}_A.h5 $D/${name}_B.h5 | head -5; fi
done
for lay in "1:" "2:--set zero_optimization.stage=1"; do
  np=${lay%%:*}; extra=${lay#*:}
  for side in A B; do bin=$A; [ $side = B ] && bin=$B
    mpirun --oversubscribe --allow-run-as-root -np $np $bin configs/small.yaml --resume none --set train_steps=8 --set steps_per_print=1 --set data.eval_interval=0 --set checkpoint.interval=0 --set checkpoint.save_at_end=false --set checkpoint.dir=$D/ck$side --set monitor.metrics_file=$D/m_${np}_$side.jsonl --set monitor.expert_stats_interval=0 $extra >/dev/null 2>&1 || echo "small np $np $side failed"
    python3 -c "
import json,sys
for l in open('$D/m_${np}_$side.jsonl'):
    r=json.loads(l)
    if 'loss' in r: print(r.get('step'), repr(r['loss']), repr(r.get('grad_norm')))
" > $D/c_${np}_$side.txt
  done
  if cmp -s $D/c_${np}_A.txt $D/c_${np}_B.txt && [ -s $D/c_${np}_A.txt ]; then echo "small np $np curve: identical ($(wc -l < $D/c_${np}_A.txt) steps)"; else echo "small np $np curve: DIFFERENT"; diff $D/c_${np}_A.txt $D/c_${np}_B.txt | head -4; fi
done
