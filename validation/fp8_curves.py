#!/usr/bin/env python3
"""Trains one deck in a baseline precision and in each FP8 recipe and plots the loss curves.

    validation/fp8_curves.py --plm build/plm --deck inputs/esm2_35m.yaml \\
        --train data/mm/train.h5 --valid data/mm/valid.h5 --steps 2000 \\
        --out doc/img/fp8_loss.png [--baseline bf16] [--recipes delayed,current,block] \\
        [--set key=value ...] [--launcher "mpiexec -n 2"] [--work /tmp/fp8_curves] \\
        [--table doc/fp8_curves.md] [--tol 0.01]

Every run is the same deck with train.precision and fp8.recipe overridden (and train.steps,
data.*, run and checkpoint directories, checkpoint.resume none); the extra --set options go to
every run (a small model for a CPU check, eval cadence, ...).  The picture has the training
losses (raw, faint, and a moving average) and the validation losses of every run side by side;
the table (stdout, and --table as Markdown) gives each run's final training loss (mean of the
last 5% of steps), final validation loss and its relative difference to the baseline's.
Issue 10's target: each FP8 recipe's final validation loss within 1% of BF16 (--tol 0.01 makes
the exit status 1 when a recipe misses it).  Exit status 1 also when a run fails or logs no
metrics; 2 when matplotlib is missing (scripts/setup-debian.sh installs python3-matplotlib).
"""
import argparse
import os
import sys

from run_metrics import smooth, tail_mean, train_run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plm", required=True, help="the plm executable")
    ap.add_argument("--deck", required=True)
    ap.add_argument("--train", required=True, help="training set (plm prep)")
    ap.add_argument("--valid", default="", help="validation set (plm prep); empty = none")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", default="doc/img/fp8_loss.png", help="PNG path")
    ap.add_argument("--baseline", default="bf16", help="precision of the reference run")
    ap.add_argument("--recipes", default="delayed,current,block")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="deck override for every run (repeatable)")
    ap.add_argument("--launcher", default="", help='e.g. "mpiexec -n 2" (default: none)')
    ap.add_argument("--work", default="fp8_curves", help="directory of the runs")
    ap.add_argument("--table", default="", help="also write the table here (Markdown)")
    ap.add_argument("--tol", type=float, default=0.0,
                    help="fail when a recipe's final validation loss differs from the "
                         "baseline's by more than this (relative; 0 = report only)")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("fp8_curves: matplotlib is missing (python3-matplotlib)", file=sys.stderr)
        return 2

    runs = [(a.baseline, a.baseline, None)]
    runs += [(f"fp8 {r}", "fp8", r) for r in a.recipes.split(",") if r]
    os.makedirs(a.work, exist_ok=True)
    results = []
    for label, precision, recipe in runs:
        name = label.replace(" ", "_")
        sets = [f"train.precision={precision}", f"train.steps={a.steps}",
                f"data.train={a.train}", f"data.valid={a.valid}"]
        if recipe:
            sets.append(f"fp8.recipe={recipe}")
        rc, records, evals = train_run("fp8_curves", a.plm, a.deck, a.launcher, a.work, name,
                                       sets + a.sets)
        if rc != 0 or not records:
            print(f"fp8_curves: {label} failed; see {a.work}/{name}.log", file=sys.stderr)
            return 1
        results.append((label, records, evals))

    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, train, evals in results:
        steps = sorted(train)
        losses = [train[s]["loss"] for s in steps]
        line, = ax_train.plot(steps, smooth(losses, max(1, len(steps) // 50)), label=label)
        ax_train.plot(steps, losses, color=line.get_color(), alpha=0.2, linewidth=0.7)
        if evals:
            es = sorted(evals)
            ax_valid.plot(es, [evals[s] for s in es], marker="o", markersize=3, label=label,
                          color=line.get_color())
    ax_train.set_xlabel("optimizer step")
    ax_train.set_ylabel("training loss (masked-token cross-entropy)")
    ax_train.set_title("training loss (moving average; raw faint)")
    ax_train.legend()
    ax_valid.set_xlabel("optimizer step")
    ax_valid.set_ylabel("validation loss")
    ax_valid.set_title("validation loss" if any(e for _, _, e in results) else
                       "validation loss (no validation set)")
    ax_valid.legend()
    fig.suptitle(f"{os.path.basename(a.deck)}: {a.baseline} vs FP8 recipes, {a.steps} steps")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)

    base_valid = results[0][2][max(results[0][2])] if results[0][2] else None
    base_train = tail_mean(results[0][1])
    rows = ["| run | final training loss | vs baseline | final validation loss | vs baseline |",
            "|---|---|---|---|---|"]
    failed = []
    for label, train, evals in results:
        t = tail_mean(train)
        v = evals[max(evals)] if evals else None
        dv = (v - base_valid) / base_valid if v is not None and base_valid else None
        rows.append(f"| {label} | {t:.4f} | {100 * (t - base_train) / base_train:+.2f}% | "
                    + (f"{v:.4f} | {100 * dv:+.2f}% |" if dv is not None else
                       (f"{v:.4f} | |" if v is not None else "- | |")))
        if a.tol > 0 and label != a.baseline:
            d = dv if dv is not None else (t - base_train) / base_train
            if abs(d) > a.tol:
                failed.append(f"{label}: {100 * d:+.2f}%")
    table = "\n".join(rows)
    print(table)
    print(f"fp8_curves: wrote {a.out}")
    if a.table:
        with open(a.table, "w") as f:
            f.write(table + "\n")
    if failed:
        print(f"fp8_curves: beyond {100 * a.tol:g}% of the baseline: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
