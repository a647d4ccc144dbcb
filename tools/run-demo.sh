#!/usr/bin/env bash
# The main job on the shipped default: install missing packages, build, and run dstrain on
# configs/small.yaml with the shipped corpus (data/tinyshakespeare.txt). Extra arguments go to
# dstrain (e.g. --set parallel.tensor=2). Until the training loop lands, the main job is the
# dry run: the resolved plan of the small preset.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
exec build/bin/dstrain configs/small.yaml --dry-run "$@"
