# Sourced by tools/bench-{dp,tp,pp,ep}.sh: run from the repository root, the binary of the build
# directory given as the script's first argument (default build/), a scratch directory removed
# at exit, and `common`: 60 steps of the small preset printing every 20, with the step-time
# breakdown, no validation, no intermediate checkpoints, metrics into the scratch directory.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build}/bin/dstrain
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
common=(configs/small.yaml --set train_steps=60 --set steps_per_print=20 --set data.eval_interval=0
        --set checkpoint.interval=0 --set checkpoint.dir="$OUT/ck" --set checkpoint.resume=none
        --set wall_clock_breakdown=true --set monitor.metrics_file="$OUT/m.jsonl"
        --set monitor.expert_stats_interval=0)
calc() { awk "BEGIN { print $1 }"; }
