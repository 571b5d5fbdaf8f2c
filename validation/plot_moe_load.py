#!/usr/bin/env python3
"""Expert load over training from a plm run's metrics.jsonl (MoE models).

    validation/plot_moe_load.py RUN_DIR/metrics.jsonl [--out moe_load.png]

For every MoE layer: tokens per expert max/mean and min/mean per logged interval (the balance
target is max/mean <= 1.3 after warm-up), the dropped-slot fraction, the aux loss and the router
entropy (with more than 8 MoE layers: the worst, median and best layer per step).  Without
matplotlib it prints the same numbers as a table.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("--out", default="moe_load.png")
    args = ap.parse_args()
    rows = []
    with open(args.metrics) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train" and "moe" in r:
                rows.append(r)
    if not rows:
        sys.exit(f"{args.metrics}: no train record with MoE statistics (a dense model?)")
    layers = [l["layer"] for l in rows[0]["moe"]]
    steps = [r["step"] for r in rows]

    def series(key, layer_index, scale=None):
        out = []
        for r in rows:
            l = r["moe"][layer_index]
            v = l[key]
            out.append(v / l["tokens_per_expert_mean"] if scale and l["tokens_per_expert_mean"] else v)
        return out

    print("step " + " ".join(f"L{l}:max/mean" for l in layers) + "  drop%  aux  entropy")
    for i, s in enumerate(steps):
        ratios = " ".join(
            f"{rows[i]['moe'][j]['tokens_per_expert_max'] / max(rows[i]['moe'][j]['tokens_per_expert_mean'], 1e-12):10.3f}"
            for j in range(len(layers)))
        m = rows[i]["moe"]
        drop = 100 * sum(l["dropped_fraction"] for l in m) / len(m)
        aux = sum(l["aux_loss"] for l in m) / len(m)
        ent = sum(l["router_entropy"] for l in m) / len(m)
        print(f"{s:5d} {ratios}  {drop:5.2f}  {aux:.4f}  {ent:.3f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: table only)")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    many = len(layers) > 8  # then the worst, median and best layer per step, not one line each
    if many:
        import statistics
        hi = [[r["moe"][j]["tokens_per_expert_max"] / max(r["moe"][j]["tokens_per_expert_mean"], 1e-12)
               for j in range(len(layers))] for r in rows]
        lo = [[r["moe"][j]["tokens_per_expert_min"] / max(r["moe"][j]["tokens_per_expert_mean"], 1e-12)
               for j in range(len(layers))] for r in rows]
        ax[0].plot(steps, [max(v) for v in hi], color="C3", label="max/mean, worst layer")
        ax[0].plot(steps, [statistics.median(v) for v in hi], color="C0", label="max/mean, median layer")
        ax[0].plot(steps, [min(v) for v in lo], "--", color="C2", label="min/mean, lowest layer")
        drop = [100 * max(l["dropped_fraction"] for l in r["moe"]) for r in rows]
        ax[1].plot(steps, drop, label="worst layer")
        aux = [[l["aux_loss"] for l in r["moe"]] for r in rows]
        ax[2].plot(steps, [max(v) for v in aux], color="C3", label="worst layer")
        ax[2].plot(steps, [statistics.median(v) for v in aux], color="C0", label="median layer")
    else:
        for j, l in enumerate(layers):
            ax[0].plot(steps, series("tokens_per_expert_max", j, True), label=f"layer {l} max/mean")
            ax[0].plot(steps, series("tokens_per_expert_min", j, True), "--", label=f"layer {l} min/mean")
            ax[1].plot(steps, [100 * v for v in series("dropped_fraction", j)], label=f"layer {l}")
            ax[2].plot(steps, series("aux_loss", j), label=f"layer {l}")
    ax[0].axhline(1.3, color="gray", lw=0.8)
    ax[0].axhline(1.5, color="gray", lw=0.8, ls=":")
    ax[0].set_title(f"tokens per expert / mean ({len(layers)} MoE layers)")
    ax[1].set_title("dropped slots (%)")
    ax[2].set_title("aux loss (1 = balanced)")
    for a in ax:
        a.set_xlabel("step")
        a.legend(fontsize=6 if not many else 8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
