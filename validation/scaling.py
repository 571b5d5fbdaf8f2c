#!/usr/bin/env python3
"""Scaling studies: one deck, a list of layouts, strong and weak scaling, CSV and PNG plots.

For every layout and mode the study runs `plm train` (or writes a Slurm or PBS job for it from
the templates in jobscripts/), collects each run's metrics.jsonl and plan.json (the planner's
prediction that `plm train` writes after its first steps, doc/plan.md), and writes
scaling.csv and PNG plots: tokens/s and per-rank efficiency against ranks (strong and weak),
MFU, memory per rank, and the planner's time split beside the measured step time.

Layouts: `R` (R ranks on one node) or `NxG` (N nodes x G ranks per node), optionally followed by
`:shard=S`, `:context=C`, `:expert=E`: the deck's `parallel.shard_degree`, `context_degree` and
`expert_degree` for `plm train`, and the same degrees for `plm plan`.
Modes: strong keeps data.tokens_per_batch; weak multiplies it by the rank count (constant work
per rank).

    # on this machine, in sequence (CI: a tiny model on 1, 2 and 4 CPU ranks)
    python3 validation/scaling.py DECK --local --layouts 1 2 4 --out study --synthetic
    # one Slurm job per point, then collect when they are done
    python3 validation/scaling.py inputs/esm2_650m.yaml --scheduler slurm --layouts 1x8 2x8 4x8 --out study
    bash study/submit.sh
    python3 validation/scaling.py inputs/esm2_650m.yaml --collect --layouts 1x8 2x8 4x8 --out study

    # predictions only (plm plan for every point, nothing runs): a markdown table
    python3 validation/scaling.py inputs/esm2_15b.yaml --predict --gpu h200 --mode strong \
        --layouts 2x8:shard=8 4x8:shard=8 --set train.precision=bf16

Exit status: 0 when every point ran and was collected (or, with --predict, was planned), 1
otherwise.
"""
import argparse
import csv
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Layout:
    def __init__(self, text):
        self.text = text
        parts = text.split(":")
        m = re.fullmatch(r"(?:(\d+)x)?(\d+)", parts[0])
        if not m:
            raise ValueError("layout `%s`: expected R or NxG, then :shard=S :context=C :expert=E"
                             % text)
        self.nodes = int(m.group(1) or 1)
        self.per_node = int(m.group(2))
        self.degrees = {"shard": 1, "context": 1, "expert": 1}
        for p in parts[1:]:
            k, _, v = p.partition("=")
            if k not in self.degrees or not v.isdigit() or int(v) < 1:
                raise ValueError("layout `%s`: `%s` is not shard=S, context=C or expert=E"
                                 % (text, p))
            self.degrees[k] = int(v)
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError("layout `%s`: counts must be positive" % text)

    @property
    def ranks(self):
        return self.nodes * self.per_node

    def name(self):
        extra = "".join("_%s%d" % (k, v) for k, v in self.degrees.items() if v != 1)
        return "%dx%d%s" % (self.nodes, self.per_node, extra)


def deck_value(plm, deck, sets, section, key):
    """A key of the resolved deck (plm deck --check), as text."""
    out = subprocess.run([plm, "deck", "--check", deck] + sum([["--set", s] for s in sets], []),
                         check=True, capture_output=True, text=True).stdout
    in_section = False
    for line in out.splitlines():
        if re.fullmatch(r"\S.*:\s*", line):
            in_section = line.strip().rstrip(":") == section
        elif in_section:
            m = re.fullmatch(r"\s+%s:\s*(.*)" % re.escape(key), line)
            if m:
                return m.group(1).strip().strip("'\"")
    raise KeyError("%s.%s not in the resolved deck" % (section, key))


def synthetic_data(plm, out, sequences, seed=1):
    """Random proteins (log-normal lengths, as doc/anchors.md §6) prepared with plm prep."""
    data = os.path.join(out, "data")
    if os.path.exists(os.path.join(data, "train.h5")):
        return data
    os.makedirs(data, exist_ok=True)
    rng = random.Random(seed)
    fasta = os.path.join(data, "proteins.fasta")
    with open(fasta, "w") as f:
        for i in range(sequences):
            n = int(min(1000, max(30, rng.lognormvariate(5.3, 0.6))))
            f.write(">p%d\n%s\n" % (i, "".join(rng.choice("ACDEFGHIKLMNPQRSTVWY")
                                               for _ in range(n))))
    subprocess.run([plm, "prep", fasta, "--out", data, "--valid-fraction", "0"], check=True,
                   stdout=subprocess.DEVNULL)
    return data


def point_sets(args, layout, mode, base_tokens, run_dir):
    tokens = base_tokens * (layout.ranks if mode == "weak" else 1)
    sets = list(args.set) + [
        "data.tokens_per_batch=%d" % tokens,
        "train.run_dir=%s" % run_dir,
        "checkpoint.dir=%s/ckpt" % run_dir,
        "checkpoint.every=0",
        "checkpoint.resume=none",
        "data.valid=",
        "train.eval_every=0",
        "train.log_every=1",
    ]
    if args.steps:
        sets.append("train.steps=%d" % args.steps)
    # The layout's degrees are the deck's parallel section (doc/parallelism.md).
    sets += ["parallel.%s_degree=%d" % (k, v) for k, v in layout.degrees.items() if v != 1]
    return sets


def run_local(args, layout, sets):
    cmd = [args.plm, "train", args.deck] + sum([["--set", s] for s in sets], [])
    if layout.ranks > 1 or args.mpiexec_always:
        cmd = shlex.split(args.mpiexec) + ["-n", str(layout.ranks)] + cmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    if args.rates:  # plm train's plan.json uses the measured table
        env["PLM_RATES"] = args.rates
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print("scaling: %s ranks=%d rc=%d %.1fs" % (os.path.basename(sets_run_dir(sets)),
                                                layout.ranks, r.returncode, time.time() - t0))
    if r.returncode != 0:
        print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
    return r.returncode == 0


def sets_run_dir(sets):
    return [s for s in sets if s.startswith("train.run_dir=")][-1].split("=", 1)[1]


def write_job(args, layout, sets, jobs_dir, name):
    sets_text = " ".join("--set " + shlex.quote(s) for s in sets)
    deck = os.path.abspath(args.deck)
    if args.scheduler == "slurm":
        line = ("sbatch --job-name=plm-scaling-%s --nodes=%d --ntasks-per-node=%d "
                "--gpus-per-node=%d %s %s %s" % (name, layout.nodes, layout.per_node,
                                                 layout.per_node,
                                                 os.path.join(REPO, "jobscripts/slurm-train.sh"),
                                                 shlex.quote(deck), sets_text))
    else:
        line = ("qsub -N plm-scal-%s -l select=%d:ncpus=%d:ngpus=%d:mpiprocs=%d "
                "-v DECK=%s,GPUS_PER_NODE=%d,SETS=%s %s"
                % (name[:8], layout.nodes, 8 * layout.per_node, layout.per_node,
                   layout.per_node, shlex.quote(deck), layout.per_node,
                   shlex.quote(sets_text.replace(",", "\\,")),
                   os.path.join(REPO, "jobscripts/pbs-train.sh")))
    path = os.path.join(jobs_dir, name + ".sh")
    with open(path, "w") as f:
        f.write("#!/bin/bash\n# scaling point %s (%s), from validation/scaling.py\n%s\n"
                % (name, layout.text, line))
    os.chmod(path, 0o755)
    return path


def collect(run_dir, skip_steps):
    """Measured figures of one run: tokens/s over the steps after `skip_steps`, MFU, memory."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    recs = [json.loads(l) for l in open(path) if l.strip()]
    train = [r for r in recs if r.get("kind") == "train"]
    if not train:
        return None
    use = [r for r in train if r["step"] > skip_steps] or train[-1:]
    tokens = sum(r["interval_tokens"] for r in use)
    seconds = sum(r["interval_tokens"] / r["tokens_per_s"] for r in use if r["tokens_per_s"] > 0)
    out = {"tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
           "mfu": sum(r["mfu"] for r in use) / len(use),
           "mem_bytes": max(r["mem_bytes"] for r in use),
           "steps": len(use)}
    out["step_s"] = seconds / len(use)
    plan_path = os.path.join(run_dir, "plan.json")
    if os.path.exists(plan_path):
        out["plan"] = json.load(open(plan_path))
    return out


def plan_point(args, layout, sets):
    """plm plan for a point that has no plan.json (not run yet, or a planned degree)."""
    cmd = [args.plm, "plan", args.deck, "--json", "--gpu", args.gpu,
           "--gpus", str(layout.per_node), "--nodes", str(layout.nodes)]
    if args.rates:
        cmd += ["--rates", args.rates]
    if args.moe_load:
        cmd += ["--moe-load", str(args.moe_load)]
    for k, v in layout.degrees.items():
        cmd += ["--" + k, str(v)]
    cmd += sum([["--set", s] for s in sets], [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    # Exit status 3: planned, but it does not fit (the JSON says so); 1: an error.
    if r.returncode not in (0, 3) or "{" not in r.stdout:
        print("scaling: plm plan failed for %s: %s" % (layout.text, r.stderr.strip()),
              file=sys.stderr)
        return None
    if r.returncode == 3:
        print("scaling: plm plan: %s does not fit on the device" % layout.text, file=sys.stderr)
    return json.loads(r.stdout[r.stdout.index("{"):])


def plots(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("scaling: matplotlib is missing (bash scripts/setup-debian.sh installs "
              "python3-matplotlib): CSV only")
        return []
    made = []
    modes = sorted({r["mode"] for r in rows})

    def series(mode, key):
        pts = sorted((r["ranks"], r[key]) for r in rows
                     if r["mode"] == mode and r.get(key) not in (None, ""))
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in modes:
        x, y = series(mode, "tokens_per_s")
        axes[0].plot(x, y, "o-", label="%s, measured" % mode)
        xp, yp = series(mode, "pred_tokens_per_s")
        if xp:
            axes[0].plot(xp, yp, "x--", label="%s, planned" % mode)
        if x:
            axes[0].plot(x, [y[0] * r / x[0] for r in x], ":", color="grey")
        x, y = series(mode, "efficiency")
        axes[1].plot(x, y, "o-", label="%s, measured" % mode)
        xp, yp = series(mode, "pred_efficiency")
        if xp:
            axes[1].plot(xp, yp, "x--", label="%s, planned" % mode)
    axes[0].set(xlabel="ranks", ylabel="tokens/s", title="throughput (dotted: ideal)")
    axes[1].set(xlabel="ranks", ylabel="tokens/s per rank / 1-rank value",
                title="per-rank efficiency", ylim=(0, 1.2))
    for a in axes:
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    made.append(os.path.join(out, "scaling_throughput.png"))
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in modes:
        x, y = series(mode, "mfu")
        axes[0].plot(x, [100 * v for v in y], "o-", label="%s, measured" % mode)
        xp, yp = series(mode, "pred_mfu")
        if xp:
            axes[0].plot(xp, [100 * v for v in yp], "x--", label="%s, planned" % mode)
        x, y = series(mode, "mem_mib")
        axes[1].plot(x, y, "o-", label="%s, measured" % mode)
        xp, yp = series(mode, "pred_mem_mib")
        if xp:
            axes[1].plot(xp, yp, "x--", label="%s, planned" % mode)
    axes[0].set(xlabel="ranks", ylabel="MFU %", title="model FLOP utilisation")
    axes[1].set(xlabel="ranks", ylabel="MiB per rank", title="memory per rank")
    for a in axes:
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    made.append(os.path.join(out, "scaling_mfu_memory.png"))
    fig.savefig(made[-1], dpi=110)
    plt.close(fig)

    # The planner's time split per point, the measured step time as a marker.
    split_rows = [r for r in rows if r.get("split")]
    if split_rows:
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(split_rows)), 4.2))
        kinds = ["compute", "communication (exposed)", "optimizer", "other"]
        bottoms = [0.0] * len(split_rows)
        for k in kinds:
            vals = [r["split"].get(k, 0.0) for r in split_rows]
            ax.bar(range(len(split_rows)), vals, bottom=bottoms, label="planned: " + k)
            bottoms = [b + v for b, v in zip(bottoms, vals)]
        ax.plot(range(len(split_rows)), [r["step_s"] or 0 for r in split_rows], "k*",
                markersize=12, label="measured step")
        ax.set_xticks(range(len(split_rows)))
        ax.set_xticklabels(["%s\n%s" % (r["mode"], r["layout"]) for r in split_rows], fontsize=8)
        ax.set(ylabel="seconds per step", title="time split per step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        made.append(os.path.join(out, "scaling_time_split.png"))
        fig.savefig(made[-1], dpi=110)
        plt.close(fig)
    return made


def split_of(plan):
    split = {"compute": 0.0, "communication (exposed)": 0.0, "optimizer": 0.0, "other": 0.0}
    for item in plan["time"]["items"]:
        n = item["name"]
        if n.startswith("communication"):
            split["communication (exposed)"] += item["value"]
        elif n.startswith("optimizer"):
            split["optimizer"] += item["value"]
        elif n in ("GEMMs", "attention", "LayerNorm", "rotary, casts, epilogues", "FP8 casts"):
            split["compute"] += item["value"]
        else:
            split["other"] += item["value"]
    return split


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("deck")
    ap.add_argument("--layouts", nargs="+", required=True, help="R or NxG[:shard=S...]")
    ap.add_argument("--mode", choices=["strong", "weak", "both"], default="both")
    ap.add_argument("--out", required=True, help="study folder (runs, jobs, CSV, plots)")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--local", action="store_true", help="run every point here, in sequence")
    how.add_argument("--scheduler", choices=["slurm", "pbs"], help="write one job per point")
    how.add_argument("--collect", action="store_true", help="only collect finished runs")
    how.add_argument("--predict", action="store_true",
                     help="plan every point with plm plan, run nothing: a markdown table of "
                          "the predictions (doc/scaling.md, multi-node predictions)")
    ap.add_argument("--plm", default=os.path.join(REPO, "build", "plm"))
    ap.add_argument("--mpiexec", default="mpiexec --oversubscribe --bind-to none")
    ap.add_argument("--mpiexec-always", action="store_true", help="use mpiexec for 1 rank too")
    ap.add_argument("--gpu", default="cpu", help="rates table for the prediction")
    ap.add_argument("--steps", type=int, default=0, help="train.steps per point (0: the deck's)")
    ap.add_argument("--skip-steps", type=int, default=2, help="warm-up steps left out of rates")
    ap.add_argument("--synthetic", type=int, nargs="?", const=2000, default=0,
                    help="train on N random proteins prepared into OUT/data (default 2000)")
    ap.add_argument("--set", action="append", default=[], help="deck override for every point")
    ap.add_argument("--rates", help="rates table for the prediction (plm bench rates --out)")
    ap.add_argument("--moe-load", type=float, default=0,
                    help="MoE: plan the fullest expert rank at this load (plm plan --moe-load)")
    ap.add_argument("--bench-rates", type=float, nargs="?", const=0.3, default=0,
                    help="measure the rates table here first (plm bench rates, S seconds per "
                         "measurement, default 0.3) and predict with it")
    ap.add_argument("--require-plots", action="store_true",
                    help="fail when the PNG plots cannot be drawn (no matplotlib)")
    args = ap.parse_args()

    try:
        layouts = [Layout(t) for t in args.layouts]
    except ValueError as e:
        print("scaling: " + str(e), file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    if args.synthetic:
        data = synthetic_data(args.plm, out, args.synthetic)
        args.set.append("data.train=%s" % os.path.join(data, "train.h5"))
    if args.bench_rates:
        args.rates = os.path.join(out, "rates.json")
        subprocess.run([args.plm, "bench", "rates", "--gpu", args.gpu, "--seconds",
                        str(args.bench_rates), "--out", args.rates], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_tokens = int(deck_value(args.plm, args.deck, args.set, "data", "tokens_per_batch"))
    modes = ["strong", "weak"] if args.mode == "both" else [args.mode]

    points = []
    for mode in modes:
        for layout in layouts:
            name = "%s_%s" % (mode, layout.name())
            run_dir = os.path.join(out, "runs", name)
            points.append((mode, layout, name, run_dir,
                           point_sets(args, layout, mode, base_tokens, run_dir)))

    if args.scheduler:
        jobs = os.path.join(out, "jobs")
        os.makedirs(jobs, exist_ok=True)
        scripts = [write_job(args, lay, sets, jobs, name) for _, lay, name, _, sets in points]
        with open(os.path.join(out, "submit.sh"), "w") as f:
            f.write("#!/bin/bash\n# submits every point of the study; collect afterwards with "
                    "--collect\nset -e\n" + "".join("bash %s\n" % s for s in scripts))
        print("scaling: %d %s jobs in %s; submit with: bash %s/submit.sh"
              % (len(scripts), args.scheduler, jobs, out))
        return 0

    if args.predict:
        return predict(args, points)

    ok = True
    if args.local:
        for mode, layout, name, run_dir, sets in points:
            shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends across runs
            ok &= run_local(args, layout, sets)

    rows = []
    for mode, layout, name, run_dir, sets in points:
        m = collect(run_dir, args.skip_steps)
        if m is None:
            print("scaling: no metrics for %s in %s" % (name, run_dir), file=sys.stderr)
            ok = False
        if args.local and m is not None and "plan" not in m:
            # plm train writes plan.json after its first steps (doc/plan.md)
            print("scaling: %s: plm train wrote no plan.json" % name, file=sys.stderr)
            ok = False
        plan = (m or {}).get("plan") or plan_point(args, layout, sets)
        row = {"mode": mode, "layout": layout.text, "ranks": layout.ranks,
               "nodes": layout.nodes, "tokens_per_batch":
               base_tokens * (layout.ranks if mode == "weak" else 1),
               "tokens_per_s": m["tokens_per_s"] if m else None,
               "mfu": m["mfu"] if m else None,
               "mem_mib": m["mem_bytes"] / 2**20 if m else None,
               "step_s": m["step_s"] if m else None,
               "pred_tokens_per_s": plan["time"]["tokens_per_s"] if plan else None,
               "pred_mfu": plan["time"]["mfu"] if plan else None,
               "pred_mem_mib": plan["memory"]["total_bytes"] / 2**20 if plan else None,
               "pred_step_s": plan["time"]["step_s"] if plan else None}
        for k, v in layout.degrees.items():
            row[k] = v
        row["split"] = split_of(plan) if plan else None
        rows.append(row)
    for mode in modes:  # per-rank efficiency against the smallest layout of the mode
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
        for key, eff in (("tokens_per_s", "efficiency"), ("pred_tokens_per_s", "pred_efficiency")):
            base = next((r for r in mine if r[key]), None)
            for r in mine:
                r[eff] = (r[key] / r["ranks"]) / (base[key] / base["ranks"]) \
                    if base and r[key] else None

    fields = ["mode", "layout", "ranks", "nodes", "shard", "context", "expert",
              "tokens_per_batch", "tokens_per_s", "pred_tokens_per_s", "efficiency",
              "pred_efficiency", "mfu", "pred_mfu", "mem_mib", "pred_mem_mib", "step_s",
              "pred_step_s"]
    csv_path = os.path.join(out, "scaling.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("%.6g" % v if isinstance(v, float) else v) for k, v in r.items()
                        if k in fields})
    made = plots(rows, out)
    if args.require_plots and len(made) < 3:
        print("scaling: --require-plots: only %d of 3 plots drawn" % len(made), file=sys.stderr)
        ok = False
    for r in rows:
        if r["tokens_per_s"] is not None and not r["tokens_per_s"] > 0:
            print("scaling: %s %s measured no throughput" % (r["mode"], r["layout"]),
                  file=sys.stderr)
            ok = False
    print("scaling: wrote %s%s" % (csv_path, "".join(", " + p for p in made)))
    for r in rows:
        print("  %-6s %-10s ranks %3d: %s tokens/s (planned %s), efficiency %s, %s MiB/rank"
              % (r["mode"], r["layout"], r["ranks"], fmt(r["tokens_per_s"]),
                 fmt(r["pred_tokens_per_s"]), fmt(r.get("efficiency"), "%.2f"),
                 fmt(r["mem_mib"])))
    return 0 if ok else 1


def predict(args, points):
    """plm plan for every point: one markdown row each (predictions, nothing measured)."""
    print("| mode | layout | GPUs | tokens per step | micro-batches per GPU | memory per GPU "
          "| fits | step (s) | tokens/s per GPU | MFU | exposed communication |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for mode, layout, name, run_dir, sets in points:
        plan = plan_point(args, layout, sets)
        if plan is None:
            ok = False
            continue
        t = plan["time"]
        comm = sum(i["value"] for i in t["items"]
                   if i["name"].startswith("communication") or "all-to-all" in i["name"])
        print("| %s | %s | %d | %s | %d | %.1f GiB | %s | %.2f | %s | %.1f%% | %.0f%% |"
              % (mode, layout.text, layout.ranks, "{:,.0f}".format(t["tokens_per_step"]),
                 plan["batch"]["micro_batches_per_rank"], plan["memory"]["total_bytes"] / 2**30,
                 "yes" if plan["memory"]["fits"] else "**no**", t["step_s"],
                 "{:,.0f}".format(t["tokens_per_s_per_rank"]), 100 * t["mfu"],
                 100 * comm / t["step_s"] if t["step_s"] > 0 else 0))
    return 0 if ok else 1


def fmt(v, spec="%.0f"):
    return spec % v if isinstance(v, (int, float)) else "-"


if __name__ == "__main__":
    sys.exit(main())
