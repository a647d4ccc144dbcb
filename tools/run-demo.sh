#!/usr/bin/env bash
# The main job on the shipped default: install missing packages, build, and run dstrain on
# configs/small.yaml with the shipped corpus (data/tinyshakespeare.txt). Extra arguments go to
# dstrain (e.g. --set train_steps=300). About 8 minutes of training on 2 cores; metrics go to
# runs/small/ (tools/plot_metrics.py draws them).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
exec build/bin/dstrain configs/small.yaml "$@"
