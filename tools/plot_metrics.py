#!/usr/bin/env python3
"""Plot a dstrain metrics file (monitor.metrics_file, JSON Lines) to a PNG loss curve.

    tools/plot_metrics.py runs/small/metrics.jsonl [-o loss.png] [--title TEXT]

Training loss per logged step, validation loss where it was computed, and the learning rate on
a second axis. Needs matplotlib (python3 -m pip install matplotlib); dstrain itself does not.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics", help="JSON Lines file written by dstrain (monitor.metrics_file)")
    ap.add_argument("-o", "--output", help="PNG to write (default: the metrics path with .png)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics.py needs matplotlib: python3 -m pip install matplotlib")

    steps, loss, lr, val_steps, val = [], [], [], [], []
    with open(args.metrics) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{args.metrics}:{n}: not a JSON object ({e})")
            steps.append(row["step"])
            loss.append(row["loss"])
            lr.append(row.get("lr"))
            if row.get("val_loss") is not None:
                val_steps.append(row["step"])
                val.append(row["val_loss"])
    if not steps:
        sys.exit(f"{args.metrics}: no logged steps")

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(steps, loss, label="train loss", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot(val_steps, val, "o-", label="validation loss", color="tab:orange", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    if any(x is not None for x in lr):
        ax2 = ax.twinx()
        ax2.plot(steps, lr, color="tab:gray", linewidth=0.8, alpha=0.6, label="learning rate")
        ax2.set_ylabel("learning rate")
        lines = ax.get_lines() + ax2.get_lines()
        ax.legend(lines, [l.get_label() for l in lines], loc="upper right")
    else:
        ax.legend(loc="upper right")
    title = args.title or args.metrics
    if val:
        title += f"  (final validation loss {val[-1]:.3f})"
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = args.output or (args.metrics.rsplit(".", 1)[0] + ".png")
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
