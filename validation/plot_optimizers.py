#!/usr/bin/env python3
"""Loss curves of the optimizer comparison side by side (doc/optimizers.md, doc/img/optimizers.png).

Reads RUNS/<name>/metrics.jsonl and RUNS/<name>.log for each optimizer run that
validation/optimizers_cpu.sh wrote, draws the training loss (smoothed over 50 steps) and the
validation loss against the step, and prints a Markdown table: final validation loss, its
difference from AdamW, and the optimizer state per parameter the run logged.

    python3 validation/plot_optimizers.py runs/optimizers --out doc/img/optimizers.png

Exit status 1 when a run is missing or matplotlib is (bash scripts/setup-debian.sh installs
python3-matplotlib).
"""
import argparse
import json
import os
import re
import sys

NAMES = ["adamw", "adamw8bit", "lion", "adafactor"]


def load(run_dir):
    train, evals = {}, {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r.get("kind") == "train":
                    train[r["step"]] = r
                elif r.get("kind") == "eval":
                    evals[r["step"]] = r
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def state_line(log):
    """'optimizer: adamw, state 7 MiB on this rank (9 bytes per parameter)' -> (text, bytes/param)."""
    try:
        with open(log) as f:
            for line in f:
                m = re.search(r"optimizer: (\S+), state (.+) on this rank \(([0-9.]+) bytes", line)
                if m:
                    return m.group(2), float(m.group(3))
    except OSError:
        pass
    return "?", float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="folder with one run directory per optimizer")
    ap.add_argument("--out", default="doc/img/optimizers.png")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_optimizers: matplotlib is missing: bash scripts/setup-debian.sh installs "
              "python3-matplotlib", file=sys.stderr)
        return 1
    runs = []
    for name in NAMES:
        path = os.path.join(args.runs, name)
        if not os.path.exists(os.path.join(path, "metrics.jsonl")):
            print("plot_optimizers: %s has no metrics.jsonl" % path, file=sys.stderr)
            continue
        train, evals = load(path)
        runs.append((name, train, evals, state_line(os.path.join(args.runs, name + ".log"))))
    if not runs:
        return 1
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, train, evals, _ in runs:
        steps = [r["step"] for r in train]
        loss = [r["loss"] for r in train]
        window = 5  # records are every 10 steps: 50-step moving mean
        smooth = [sum(loss[max(0, i - window + 1):i + 1]) / len(loss[max(0, i - window + 1):i + 1])
                  for i in range(len(loss))]
        a.plot(steps, smooth, label=name)
        b.plot([r["step"] for r in evals], [r["valid_loss"] for r in evals], marker="o",
               markersize=3, label=name)
    a.set(xlabel="step", ylabel="training loss (50-step mean)", title="training")
    b.set(xlabel="step", ylabel="validation loss", title="validation (32k tokens)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Quickstart model (4 x 128), 1,000 steps of 2,048 tokens, mmseqs2 proteins, CPU")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    ref = next((e[-1]["valid_loss"] for n, _, e, _ in runs if n == "adamw" and e), None)
    print("| optimizer | final validation loss (step %d) | vs AdamW | optimizer state | bytes per parameter |"
          % runs[0][2][-1]["step"])
    print("|---|---|---|---|---|")
    for name, _, evals, (text, per) in runs:
        v = evals[-1]["valid_loss"]
        rel = "" if ref is None else "%+.2f%%" % (100 * (v - ref) / ref)
        print("| %s | %.4f | %s | %s | %.2f |" % (name, v, rel, text, per))
    print("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
