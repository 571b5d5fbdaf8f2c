#!/usr/bin/env python3
"""Draws training runs' metrics.jsonl as one PNG: look instead of read.

Panels against the optimizer step: training loss with validation perplexity, learning rate,
gradient norm, tokens/s and MFU. Several run directories are overlaid (BF16 vs FP8, dense vs
MoE, 1 vs N ranks), each labelled with its folder name; a resumed run's repeated steps keep
their last record.

    python3 validation/plot_run.py run                       # -> run/metrics.png
    python3 validation/plot_run.py runs/a runs/b --out cmp.png

Exit status 0 with the picture's path printed; 1 when a run has no metrics or matplotlib is
missing (bash scripts/setup-debian.sh installs python3-matplotlib).
"""
import argparse
import json
import math
import os
import sys


def load(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    train, evals = {}, {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            (train if r.get("kind") == "train" else evals if r.get("kind") == "eval" else {}
             )[r["step"]] = r
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (train.run_dir)")
    ap.add_argument("--out", help="PNG path (default: RUN/metrics.png for one run, "
                                  "metrics.png for several)")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_run: matplotlib is missing: bash scripts/setup-debian.sh installs "
              "python3-matplotlib", file=sys.stderr)
        return 1
    data = []
    for run in args.runs:
        try:
            train, evals = load(run)
        except OSError as e:
            print("plot_run: %s: no metrics.jsonl (%s); is it a train.run_dir?" % (run, e),
                  file=sys.stderr)
            return 1
        if not train:
            print("plot_run: %s: metrics.jsonl has no training step yet" % run, file=sys.stderr)
            return 1
        data.append((os.path.basename(os.path.normpath(run)), train, evals))

    panels = [("loss", "training loss (solid), validation perplexity (dashed, right)"),
              ("lr", "learning rate"), ("grad_norm", "gradient norm (before clipping)"),
              ("tokens_per_s", "tokens/s"), ("mfu", "MFU %")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.4 * len(panels)), sharex=True)
    for name, train, evals in data:
        steps = [r["step"] for r in train]
        for ax, (key, title) in zip(axes, panels):
            ys = [r.get(key) for r in train]
            if key == "mfu":
                ys = [100 * y if y is not None else None for y in ys]
            line, = ax.plot(steps, [y if y is not None else math.nan for y in ys], label=name)
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            if key == "loss" and evals:
                twin = ax.twinx() if not hasattr(ax, "_plm_twin") else ax._plm_twin
                ax._plm_twin = twin
                twin.plot([e["step"] for e in evals],
                          [e["valid_ppl"] if e.get("valid_ppl") is not None else math.nan
                           for e in evals], "--o", color=line.get_color(), markersize=3)
                twin.set_ylabel("valid ppl", fontsize=8)
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out = args.out or (os.path.join(args.runs[0], "metrics.png") if len(args.runs) == 1
                       else "metrics.png")
    fig.savefig(out, dpi=100)
    print("plot_run: wrote %s" % out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
