#!/usr/bin/env python3
"""Planner accuracy: `plm plan`'s prediction against measured bench_gpu_train runs.

Reads the `RESULT ...` lines that bench/gpu/bench_gpu_train.cpp prints (a log, or the summary of
validation/gpu_run.sh's `train` stage), plans each point with `plm plan --json` (the preset's
deck in inputs/, bf16, its recomputation and micro-batch, one micro-batch per optimizer step as
the benchmark runs, S = 460 as its workload draws; bf16 unless the fp8_bench stage's
"bench_gpu_train PRESET:TOKENS fp8:RECIPE" line names the run's precision), and prints a Markdown table (as in
doc/archive/performance-history.md, "Planner accuracy") with the issue's targets: memory within
10%, tokens/s within 15%.

    python3 validation/plan_accuracy.py --plm build/plm summary_h100_onemodel_run3_side_by_side.txt
        (from validation/gpu_logs/bf16-vs-hf_h100_2492b5c.tar.xz)
    python3 validation/plan_accuracy.py --plm build/plm --csv acc.csv LOG...

Exit status 0 when every point meets both targets, 1 otherwise (2 on bad input).
"""
import argparse
import csv
import json
import os
import re
import subprocess
import sys

RESULT = re.compile(
    r"RESULT (?P<preset>\S+) params (?P<params>[\d.]+)M tokens/micro-batch (?P<tokens>\d+): "
    r"(?P<tps>[\d.]+) tokens/s, .*device memory in use (?P<mem>[\d.]+) GiB "
    r"\(workspace (?P<ws>[\d.]+) GiB, recompute (?P<rc>\w+)[,)]")
# gpu_run.sh's fp8_bench stage names each run's precision before its RESULT line.
PRECISION = re.compile(r"bench_gpu_train \S+ (?P<p>bf16|fp8):?(?P<recipe>\w*)")

GIB = 1024.0 ** 3


def measured_points(paths):
    points, seen = [], set()
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            precision, recipe = "bf16", ""
            for line in f:
                named = PRECISION.match(line)
                if named:
                    precision, recipe = named["p"], named["recipe"]
                m = RESULT.search(line)
                if not m:
                    continue
                key = (m["preset"], int(m["tokens"]), m["rc"], precision, recipe)
                if key in seen:  # the first run of a point counts; later ones are repeats
                    continue
                seen.add(key)
                points.append({"preset": m["preset"], "tokens": int(m["tokens"]),
                               "recompute": m["rc"], "precision": precision,
                               "recipe": recipe or "delayed", "tokens_per_s": float(m["tps"]),
                               "mem_gib": float(m["mem"]), "workspace_gib": float(m["ws"])})
    return points


def plan(plm, repo, gpu, p, seqlen):
    deck = os.path.join(repo, "inputs", p["preset"] + ".yaml")
    cmd = [plm, "plan", deck, "--gpu", gpu, "--json", "--seqlen", str(seqlen),
           "--set", "train.precision=" + p["precision"],
           "--set", "model.recompute=" + p["recompute"],
           "--set", "data.micro_batch_tokens=%d" % p["tokens"],
           "--set", "data.tokens_per_batch=%d" % p["tokens"],
           "--set", "data.max_seq_len=1024"]
    if p["precision"] == "fp8":
        cmd += ["--set", "fp8.recipe=" + p["recipe"]]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 3):  # 3: planned, but it does not fit (doc/plan.md)
        raise SystemExit("plan_accuracy: %s failed: %s" % (" ".join(cmd), r.stderr.strip()))
    out = r.stdout
    return json.loads(out[out.index("{"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="files with bench_gpu_train RESULT lines")
    ap.add_argument("--plm", default="build/plm", help="the plm executable")
    ap.add_argument("--gpu", default="h100", help="rates table (h100, h200)")
    ap.add_argument("--seqlen", type=float, default=460.0,
                    help="token-weighted mean length of the benchmark's workload")
    ap.add_argument("--csv", help="also write the table as CSV")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    points = measured_points(args.logs)
    if not points:
        print("plan_accuracy: no RESULT lines of bench_gpu_train in " + ", ".join(args.logs),
              file=sys.stderr)
        return 2
    rows, ok = [], True
    for p in points:
        j = plan(args.plm, repo, args.gpu, p, args.seqlen)
        acts = sum(i["value"] for i in j["memory"]["items"] if i["name"].startswith("activations"))
        pred_mem = j["memory"]["total_bytes"] / GIB
        pred_tps = j["time"]["tokens_per_s"]
        mem_err = pred_mem / p["mem_gib"] - 1
        tps_err = pred_tps / p["tokens_per_s"] - 1
        good = abs(mem_err) <= 0.10 and abs(tps_err) <= 0.15
        ok &= good
        precision = p["precision"] + (" " + p["recipe"] if p["precision"] == "fp8" else "")
        rows.append({"model": p["preset"], "precision": precision, "recompute": p["recompute"],
                     "tokens": p["tokens"],
                     "pred_mem_gib": pred_mem, "mem_gib": p["mem_gib"], "mem_err": mem_err,
                     "pred_ws_gib": acts / GIB, "ws_gib": p["workspace_gib"],
                     "pred_tps": pred_tps, "tps": p["tokens_per_s"], "tps_err": tps_err,
                     "pass": good})
    print("| model | precision | recompute | tokens/micro-batch | predicted memory GiB | measured | error "
          "| predicted activations GiB | measured workspace | predicted tokens/s | measured "
          "| error | within 10% / 15% |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %s | %.1f | %.1f | %+.1f%% | %.1f | %.1f | %s | %s | %+.1f%% | %s |" % (
            r["model"], r["precision"], r["recompute"], "{:,}".format(r["tokens"]), r["pred_mem_gib"],
            r["mem_gib"], 100 * r["mem_err"], r["pred_ws_gib"], r["ws_gib"],
            "{:,.0f}".format(r["pred_tps"]), "{:,.0f}".format(r["tps"]), 100 * r["tps_err"],
            "yes" if r["pass"] else "**no**"))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
