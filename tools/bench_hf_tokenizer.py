#!/usr/bin/env python3
"""Throughput reference for Hugging Face `tokenizers` (Rust) on the tokenizer.json files in
tests/data/hf_tokenizer, to compare the C++ tokenizer against.

Developer tool, not run in CI:
    python3 -m pip install tokenizers transformers
    tools/bench_hf_tokenizer.py [--mb 10] [--threads 1,0] [--repeat 2] [--names gpt2,deepseek_v3]

The text (~--mb MB of UTF-8) is the long mixed paragraph of tools/make_tokenizer_golden.py plus every
*.txt under the repository's data/, repeated until it is big enough, then cut into documents of
about 2 KB (2,048 bytes or more) at line ends. --write PATH saves that text, which
`dstrain-bench tokenizer --input PATH` cuts into the same documents (tools/bench-tokenizer.sh). For each tokenizer and each thread count it times

    batch:  Tokenizer.from_file(...).encode_batch(docs, add_special_tokens=False)   (rayon threads)
    loop:   [tok.encode(d, add_special_tokens=False) for d in docs]                  (one thread)

and prints tokens/s and MB/s (best of --repeat runs, after one untimed warm-up on the first 200
documents). A thread count of 1 runs the measurement in a child process with RAYON_NUM_THREADS=1
(rayon reads it once, when its pool starts); 0 means rayon's default (all cores). The `loop` figure
does not depend on the thread count and is measured in the single-thread run only.
"""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data", "hf_tokenizer")
SHARED = os.path.join(HERE, "..", "data")  # the repository's shipped text


def corpus(mb):
    sys.path.insert(0, HERE)
    from make_tokenizer_golden import long_paragraph  # noqa: E402  (the golden texts' mixed paragraph)
    pieces = [long_paragraph()]
    for p in sorted(glob.glob(os.path.join(SHARED, "**", "*.txt"), recursive=True)):
        with open(p, encoding="utf-8", errors="replace") as f:
            pieces.append(f.read())
    unit = "\n".join(pieces)
    target = int(mb * 1e6)
    text = unit * max(1, -(-target // len(unit.encode("utf-8"))))
    docs, cur, size = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        size += len(line.encode("utf-8"))
        if size >= 2048:
            docs.append("".join(cur))
            cur, size = [], 0
    if cur:
        docs.append("".join(cur))
    # trim to about `target` bytes
    out, total = [], 0
    for d in docs:
        if total >= target:
            break
        out.append(d)
        total += len(d.encode("utf-8"))
    return out, total, [os.path.relpath(p, SHARED) for p in sorted(glob.glob(os.path.join(SHARED, "**", "*.txt"), recursive=True))]


def measure(name, mb, repeat, do_loop):
    """Runs in the process whose RAYON_NUM_THREADS is already set. Returns a dict of results."""
    import tokenizers
    docs, nbytes, _ = corpus(mb)
    tok = tokenizers.Tokenizer.from_file(os.path.join(DATA, name, "tokenizer.json"))
    tok.encode_batch(docs[:200], add_special_tokens=False)  # warm-up (caches, thread pool)
    res = {"name": name, "docs": len(docs), "bytes": nbytes, "tokenizers": tokenizers.__version__}
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        enc = tok.encode_batch(docs, add_special_tokens=False)
        dt = time.perf_counter() - t0
        ntok = sum(len(e.ids) for e in enc)
        best = dt if best is None else min(best, dt)
    res.update(batch_s=best, tokens=ntok)
    if do_loop:
        best = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = 0
            for d in docs:
                n += len(tok.encode(d, add_special_tokens=False).ids)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        assert n == ntok, (n, ntok)
        res["loop_s"] = best
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=10.0, help="text size in MB (default 10)")
    ap.add_argument("--threads", default="1,0", help="comma-separated rayon thread counts; 0 = default (all cores)")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per measurement; the best is reported")
    ap.add_argument("--names", default="gpt2,deepseek_v3")
    ap.add_argument("--write", help="save the text to this file (and measure nothing)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: name:loop, run one measurement, print JSON
    args = ap.parse_args()

    if args.child:
        name, loop = args.child.split(":")
        print(json.dumps(measure(name, args.mb, args.repeat, loop == "1")))
        return

    docs, nbytes, shared = corpus(args.mb)
    if args.write:
        with open(args.write, "w", encoding="utf-8", newline="") as f:
            f.write("".join(docs))
        return
    print(f"text: {nbytes / 1e6:.2f} MB in {len(docs)} documents (mixed paragraph + {shared or 'no shared files'})")
    try:
        cpu = [l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
               if l.startswith("Model name")][0]
    except Exception:  # noqa: BLE001
        cpu = "?"
    print(f"CPU: {cpu}, {os.cpu_count()} logical cores; load average {os.getloadavg()[0]:.2f}")
    for name in args.names.split(","):
        for th in (int(t) for t in args.threads.split(",")):
            env = dict(os.environ, TOKENIZERS_PARALLELISM="true")
            env.pop("RAYON_NUM_THREADS", None)
            if th > 0:
                env["RAYON_NUM_THREADS"] = str(th)
            loop = "1" if th == 1 else "0"
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{name}:{loop}",
                                  "--mb", str(args.mb), "--repeat", str(args.repeat)],
                                 env=env, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(out.stderr)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            label = f"RAYON_NUM_THREADS={th}" if th > 0 else f"rayon default ({os.cpu_count()} threads)"
            print(f"{name:12s} {label:28s} encode_batch: {r['tokens'] / r['batch_s'] / 1e6:6.3f} M tokens/s, "
                  f"{r['bytes'] / r['batch_s'] / 1e6:6.2f} MB/s ({r['tokens']} tokens, {r['batch_s']:.2f} s)")
            if "loop_s" in r:
                print(f"{name:12s} {'single-threaded encode loop':28s} encode      : "
                      f"{r['tokens'] / r['loop_s'] / 1e6:6.3f} M tokens/s, {r['bytes'] / r['loop_s'] / 1e6:6.2f} MB/s "
                      f"({r['loop_s']:.2f} s)")


if __name__ == "__main__":
    main()
