#!/usr/bin/env bash
# The main job on the shipped default: install missing packages, build, and run dstrain on
# configs/small.yaml with the shipped corpus (data/tinyshakespeare.txt). Extra arguments go to
# dstrain (e.g. --set train_steps=300). About 8 minutes of training on 2 cores; metrics go to
# runs/small/ (tools/plot_metrics.py draws them). Ends by showing what the model learnt: a
# continuation of a prompt from the newest checkpoint (dstrain generate).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
build/bin/dstrain configs/small.yaml "$@"
ckpt_dir=$(build/bin/dstrain configs/small.yaml "$@" --print-config | sed -n '/^checkpoint:/,/^[^ ]/s/^  dir: //p')
echo "--- a sample from the newest checkpoint in $ckpt_dir:"
build/bin/dstrain generate "$ckpt_dir" --prompt "ROMEO:" --max-new-tokens 300 --seed 1
