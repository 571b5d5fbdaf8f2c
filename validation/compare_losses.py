#!/usr/bin/env python3
"""Compare the per-step training losses of two `plm train` runs of the same deck.

    validation/compare_losses.py REF/metrics.jsonl RUN/metrics.jsonl [--tol 0.03] [--steps 50]

Prints, per step, both losses and their relative difference |run - ref| / |ref|, then the
largest one; exits 1 when a step is missing from either run or a difference exceeds --tol.
doc/gpu.md says which tolerance applies to which pair of runs and why (CPU fp32 vs GPU fp32:
1e-4; vs GPU bf16 from the same checkpoint: 1e-3; vs GPU bf16 from scratch: 3e-2 per step and
1e-2 on the mean, with loss-spike steps as the known exception).
"""
import argparse
import json
import sys


def losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("kind") == "train" and "loss" in rec:
                out[int(rec["step"])] = float(rec["loss"])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref", help="metrics.jsonl of the reference run (CPU, fp32)")
    p.add_argument("run", help="metrics.jsonl of the run to check")
    p.add_argument("--tol", type=float, default=3e-2, help="largest relative difference allowed")
    p.add_argument("--mean-tol", type=float, default=None,
                   help="largest mean relative difference allowed (default: not checked)")
    p.add_argument("--steps", type=int, default=0,
                   help="steps 1..N must be present in both (0 = the steps both runs logged)")
    a = p.parse_args()
    ref, run = losses(a.ref), losses(a.run)
    steps = range(1, a.steps + 1) if a.steps else sorted(set(ref) & set(run))
    missing = [s for s in steps if s not in ref or s not in run]
    if missing or not steps:
        print(f"compare_losses: steps missing from a run: {missing[:10]}", file=sys.stderr)
        return 1
    worst, worst_step, mean = 0.0, steps[0], 0.0
    print(f"{'step':>5} {'ref loss':>12} {'run loss':>12} {'rel diff':>10}")
    for s in steps:
        rel = abs(run[s] - ref[s]) / abs(ref[s])
        mean += rel
        if rel > worst:
            worst, worst_step = rel, s
        print(f"{s:5d} {ref[s]:12.6f} {run[s]:12.6f} {rel:10.2e}")
    mean /= len(steps)
    ok = worst <= a.tol and (a.mean_tol is None or mean <= a.mean_tol)
    bounds = f"tolerance {a.tol:.1e}" + ("" if a.mean_tol is None else f", mean {a.mean_tol:.1e}")
    print(f"max rel diff {worst:.3e} at step {worst_step}, mean {mean:.3e} over {len(steps)} steps, "
          f"{bounds}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
