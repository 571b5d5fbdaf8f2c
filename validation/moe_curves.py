#!/usr/bin/env python3
"""MoE against the dense model of equal active FLOPs, trained on the same tokens (issue 17's target 2).

    validation/moe_curves.py --plm build/plm --deck validation/moe_curves_cpu.yaml \\
        --train data/mm/train.h5 --valid data/mm/valid.h5 --steps 400 \\
        --moe-set moe.experts=8 --moe-set moe.top_k=2 --moe-set moe.expert_ffn=256 \\
        [--dense-set model.ffn=512] [--set key=value ...] [--launcher "mpiexec -n 2"] \\
        [--work /tmp/moe_curves] [--out doc/img/moe_curves.png] [--table moe_curves.md] \\
        [--warmup 50] [--balance 1.3] [--plot-only]

Both runs are the same deck with the same data order, masking seed, batch size and step count, so
they see exactly the same tokens; the MoE run adds the --moe-set overrides (its `moe` section:
8 experts, top-2, expert_ffn = the dense ffn / top_k gives equal active FLOPs per token, the
router's E x H aside), the dense run the --dense-set ones.  Every run logs each step
(train.log_every = 1), so the load figures are per step, not averaged over an interval.

The picture: training loss (moving average) and validation loss of both runs against the tokens
seen, and max/mean (and min/mean) tokens per expert of every MoE layer per step with the 1.3
line.  The table (stdout, --table as Markdown): final validation losses and their difference,
and per MoE layer max/mean after --warmup steps (median, 95th percentile, maximum, and the share
of steps <= --balance).  Exit status 1 when a run fails or logs nothing; 2 without matplotlib
(then --plot-only redraws from --work once it is installed).
"""
import argparse
import json
import os
import statistics
import sys

from run_metrics import load, smooth, tail_mean, train_run

RUNS = ("dense", "moe")


def tokens_at(train):
    """step -> tokens seen after it (`tokens` is cumulative; `interval_tokens` per log line)."""
    return {s: int(train[s].get("tokens", 0)) for s in sorted(train)}


def balance(train, warmup):
    """{layer: [max/mean per step after warm-up]}, {layer: [min/mean ...]}, steps."""
    hi, lo, steps = {}, {}, []
    for s in sorted(train):
        if s <= warmup or "moe" not in train[s]:
            continue
        steps.append(s)
        for l in train[s]["moe"]:
            mean = l["tokens_per_expert_mean"]
            if mean > 0:
                hi.setdefault(l["layer"], []).append(l["tokens_per_expert_max"] / mean)
                lo.setdefault(l["layer"], []).append(l["tokens_per_expert_min"] / mean)
    return hi, lo, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plm", default="build/plm", help="the plm executable")
    ap.add_argument("--deck", required=True, help="the dense model's deck (both runs)")
    ap.add_argument("--train", default="", help="training set (plm prep)")
    ap.add_argument("--valid", default="", help="validation set (plm prep)")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--moe-set", action="append", default=[], dest="moe_sets",
                    help="override of the MoE run only (repeatable; its moe section)")
    ap.add_argument("--dense-set", action="append", default=[], dest="dense_sets",
                    help="override of the dense run only (repeatable)")
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="override of both runs (repeatable)")
    ap.add_argument("--launcher", default="", help='e.g. "mpiexec -n 2" (default: none)')
    ap.add_argument("--work", default="moe_curves", help="directory of the runs")
    ap.add_argument("--out", default="doc/img/moe_curves.png", help="PNG path")
    ap.add_argument("--table", default="", help="also write the table here (Markdown)")
    ap.add_argument("--title", default="", help="picture title (default: the deck's name)")
    ap.add_argument("--warmup", type=int, default=50,
                    help="steps left out of the load statistics (router warm-up)")
    ap.add_argument("--balance", type=float, default=1.3, help="target max/mean tokens per expert")
    ap.add_argument("--plot-only", action="store_true",
                    help="train nothing; redraw and tabulate the runs under --work")
    a = ap.parse_args()

    if not a.plot_only:
        if not (a.train and a.steps > 0 and a.moe_sets):
            ap.error("--train, --steps and --moe-set are needed unless --plot-only")
        os.makedirs(a.work, exist_ok=True)
        for name, extra in (("dense", a.dense_sets), ("moe", a.moe_sets)):
            sets = [f"train.steps={a.steps}", f"data.train={a.train}", f"data.valid={a.valid}",
                    "train.log_every=1"] + a.sets + extra
            rc, train, _ = train_run("moe_curves", a.plm, a.deck, a.launcher, a.work, name, sets)
            if rc != 0 or not train:
                print(f"moe_curves: {name} failed; see {a.work}/{name}.log", file=sys.stderr)
                return 1

    results = {}
    for name in RUNS:
        train, evals = load(os.path.join(os.path.abspath(a.work), name))
        if not train:
            print(f"moe_curves: no metrics for {name} under {a.work}", file=sys.stderr)
            return 1
        results[name] = (train, evals, tokens_at(train))
    # Same tokens: the two runs' per-step token counts must agree (same data order and batches).
    td, tm = results["dense"][2], results["moe"][2]
    common = sorted(set(td) & set(tm))
    mismatch = [s for s in common if td[s] != tm[s]]

    def last_valid(evals):
        return (max(evals), evals[max(evals)]) if evals else (None, None)

    rows = ["| run | parameters | tokens | final training loss | final validation loss |",
            "|---|---|---|---|---|"]
    params = {}
    for name in RUNS:
        log = os.path.join(os.path.abspath(a.work), name, "metrics.jsonl")
        with open(log) as f:
            for line in f:
                r = json.loads(line)
                if r.get("kind") == "event" and r.get("event") == "start":
                    params[name] = r.get("parameters")
                    break
    for name in RUNS:
        train, evals, tok = results[name]
        vs, v = last_valid(evals)
        rows.append(f"| {name} | {params.get(name, '?'):,} | {tok[max(tok)]:,} | "
                    f"{tail_mean(train):.4f} | " + (f"{v:.4f} (step {vs})" if v else "-") + " |")
    _, vd = last_valid(results["dense"][1])
    _, vm = last_valid(results["moe"][1])
    verdict = ""
    if vd and vm:
        verdict = (f"MoE {'below' if vm < vd else 'NOT below'} dense at equal tokens: validation "
                   f"{vm:.4f} vs {vd:.4f} ({100 * (vm - vd) / vd:+.2f}%)")
    hi, lo, steps = balance(results["moe"][0], a.warmup)
    rows += ["", f"MoE load after step {a.warmup} ({len(steps)} steps), tokens per expert / mean:",
             "", "| layer | max/mean median | p95 | max | steps <= %.2f | min/mean median |" % a.balance,
             "|---|---|---|---|---|---|"]
    all_hi = []
    for layer in sorted(hi):
        v = sorted(hi[layer])
        all_hi += v
        p95 = v[min(len(v) - 1, int(0.95 * len(v)))]
        ok = sum(1 for x in v if x <= a.balance) / len(v)
        rows.append(f"| {layer} | {statistics.median(v):.3f} | {p95:.3f} | {v[-1]:.3f} | "
                    f"{100 * ok:.1f}% | {statistics.median(lo[layer]):.3f} |")
    if all_hi:
        all_hi.sort()
        verdict += ("; " if verdict else "") + (
            f"load max/mean after warm-up: median {statistics.median(all_hi):.3f}, "
            f"p95 {all_hi[int(0.95 * (len(all_hi) - 1))]:.3f}, worst {all_hi[-1]:.3f} "
            f"(target <= {a.balance})")
    if mismatch:
        verdict += f"; WARNING: tokens differ at {len(mismatch)} steps (first {mismatch[0]})"
    table = "\n".join(rows + ["", verdict])
    print(table)
    if a.table:
        with open(a.table, "w") as f:
            f.write(table + "\n")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("moe_curves: matplotlib is missing (python3-matplotlib); rerun with --plot-only",
              file=sys.stderr)
        return 2
    fig, (ax_t, ax_v, ax_b) = plt.subplots(1, 3, figsize=(17, 4.8))
    for name in RUNS:
        train, evals, tok = results[name]
        steps = sorted(train)
        x = [tok[s] / 1e6 for s in steps]
        losses = [train[s]["loss"] for s in steps]
        line, = ax_t.plot(x, smooth(losses, max(1, len(steps) // 40)), label=name)
        ax_t.plot(x, losses, color=line.get_color(), alpha=0.15, linewidth=0.6)
        if evals:
            es = sorted(evals)
            ax_v.plot([tok[s] / 1e6 for s in es], [evals[s] for s in es], marker="o",
                      markersize=3, label=f"{name} ({params.get(name, 0) / 1e6:.2f}M params)",
                      color=line.get_color())
    train = results["moe"][0]
    msteps = [s for s in sorted(train) if "moe" in train[s]]
    if msteps:
        for j, l in enumerate(train[msteps[0]]["moe"]):
            ratio = [train[s]["moe"][j]["tokens_per_expert_max"] /
                     max(train[s]["moe"][j]["tokens_per_expert_mean"], 1e-12) for s in msteps]
            low = [train[s]["moe"][j]["tokens_per_expert_min"] /
                   max(train[s]["moe"][j]["tokens_per_expert_mean"], 1e-12) for s in msteps]
            line, = ax_b.plot(msteps, ratio, linewidth=0.8, label=f"layer {l['layer']} max/mean")
            ax_b.plot(msteps, low, "--", linewidth=0.6, color=line.get_color(), alpha=0.6)
    ax_b.axhline(a.balance, color="gray", lw=0.8, label=f"{a.balance} (target)")
    ax_b.axvline(a.warmup, color="gray", lw=0.6, ls=":")
    ax_b.set_ylim(0, 2.5)  # the first steps reach 3-4 (max) and 0 (min): the target's scale
    ax_b.set_xlabel("optimizer step")
    ax_b.set_title("MoE tokens per expert: max/mean (solid), min/mean (dashed)")
    ax_b.legend(fontsize=7)
    ax_t.set_xlabel("tokens seen (M)")
    ax_t.set_ylabel("masked-token cross-entropy")
    ax_t.set_title("training loss (moving average; raw faint)")
    ax_t.legend()
    ax_v.set_xlabel("tokens seen (M)")
    ax_v.set_title("validation loss")
    ax_v.legend()
    fig.suptitle(a.title or f"{os.path.basename(a.deck)}: MoE vs dense of equal active FLOPs")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=110)
    print(f"moe_curves: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
