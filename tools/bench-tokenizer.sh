#!/usr/bin/env bash
# Hugging Face tokenizers: dstrain's C++ encode (dstrain-bench tokenizer, one thread) beside the
# `tokenizers` library's (tools/bench_hf_tokenizer.py: one thread, and its default threads) on
# the same ~MB megabytes of text in the same ~2 KB documents, for GPT-2's and DeepSeek-V3's
# tokenizer.json. The Python side needs `pip install tokenizers transformers` (developer machine);
# without it only dstrain's figure is printed.  Usage: tools/bench-tokenizer.sh [build-dir] [MB]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-build}/bin/dstrain-bench
MB=${2:-10}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
if python3 -c "import tokenizers, transformers" 2>/dev/null; then
  python3 tools/bench_hf_tokenizer.py --mb "$MB" --write "$OUT/text.txt"
  python3 tools/bench_hf_tokenizer.py --mb "$MB" --threads 1,0
else
  echo "(no tokenizers library here: dstrain's figures only, on data/tinyshakespeare.txt)"
  cp data/tinyshakespeare.txt "$OUT/text.txt"
fi
for name in gpt2 deepseek_v3; do
  "$BIN" tokenizer --tokenizer "tests/data/hf_tokenizer/$name/tokenizer.json" --input "$OUT/text.txt"
done
