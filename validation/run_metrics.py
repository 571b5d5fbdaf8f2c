"""What the validation/ curve scripts share: reading a run's metrics.jsonl, smoothing a loss
curve, the mean of its last steps, and one `plm train` run with deck overrides and its log.

Used by fp8_curves.py (FP8 recipes against a baseline precision) and moe_curves.py (MoE against
the dense model of equal active FLOPs); both run as scripts, so this file's folder is on
sys.path.
"""
import json
import os
import shlex
import subprocess
import time


def load(run_dir):
    """({step: the training record}, {step: validation loss}) of a run's metrics.jsonl
    (both empty when the run logged nothing)."""
    train, evals = {}, {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return train, evals
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("kind") == "train" and "loss" in r:
                train[int(r["step"])] = r
            elif r.get("kind") == "eval" and "valid_loss" in r:
                evals[int(r["step"])] = float(r["valid_loss"])
    return train, evals


def smooth(values, window):
    """Trailing moving average over `window` values (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def tail_mean(train):
    """Mean training loss of the last 5% of the logged steps (at least one)."""
    steps = sorted(train)
    k = max(1, len(steps) // 20)
    return sum(train[s]["loss"] for s in steps[-k:]) / k


def train_run(tool, plm, deck, launcher, work, name, sets):
    """Runs `[launcher] plm train deck --set ...` with its output in work/name.log and its run
    directory (metrics, checkpoints) in work/name; returns (exit status, training records,
    validation losses)."""
    run_dir = os.path.join(os.path.abspath(work), name)
    sets = [f"train.run_dir={run_dir}", f"checkpoint.dir={run_dir}/ckpt",
            "checkpoint.resume=none", "checkpoint.every=0"] + list(sets)
    cmd = shlex.split(launcher) + [plm, "train", deck]
    for s in sets:
        cmd += ["--set", s]
    print(f"{tool}:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    start = time.time()
    with open(os.path.join(os.path.abspath(work), name + ".log"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    train, evals = load(run_dir)
    print(f"{tool}: {name}: rc={rc}, {len(train)} steps logged, {time.time() - start:.0f} s",
          flush=True)
    return rc, train, evals
