#!/usr/bin/env python3
"""Read a plm run's TensorBoard event file back with the tensorboard package and check it
against the run's metrics.jsonl.

    python3 validation/tb_read.py RUN_DIR

RUN_DIR is a train.run_dir of a run with train.tensorboard: true (it holds metrics.jsonl and
tb/events.out.tfevents.*).  Every "train" record's loss, lr, grad_norm, tokens/s, per-device
TFLOP/s and MFU, and every "eval" record's valid_loss, must appear as a scalar at its step
(float32 precision).  Exit status: 0 fine, 1 a check failed, 2 usage, 77 the tensorboard package
is not installed (the ctest treats that as skipped).
"""
import json
import math
import os
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError as e:  # pragma: no cover
    print(f"tb_read.py: needs the tensorboard package ({e}); pip install tensorboard",
          file=sys.stderr)
    sys.exit(77)

TRAIN = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
         "perf/tokens_per_s": "tokens_per_s", "perf/tflops_per_device": "tflops_per_device",
         "perf/mfu": "mfu"}
EVAL = {"eval/valid_loss": "valid_loss", "eval/valid_ppl": "valid_ppl"}


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    run = sys.argv[1]
    tb = os.path.join(run, "tb")
    files = sorted(f for f in os.listdir(tb) if f.startswith("events.out.tfevents."))
    if not files:
        print(f"tb_read.py: no event file in {tb}", file=sys.stderr)
        return 1
    acc = event_accumulator.EventAccumulator(
        tb, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    failures = 0
    checked = 0
    for kind, table in (("train", TRAIN), ("eval", EVAL)):
        want = [r for r in records if r["kind"] == kind]
        for tag, field in table.items():
            if tag not in tags:
                print(f"missing tag {tag} (have {sorted(tags)})")
                failures += 1
                continue
            got = {e.step: e.value for e in acc.Scalars(tag)}
            for r in want:
                expected = r[field]
                value = got.get(r["step"])
                if value is None or expected is None:
                    ok = value is None and expected is None
                else:
                    ok = math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-30)
                if not ok:
                    print(f"{tag} at step {r['step']}: event file {value}, metrics.jsonl {expected}")
                    failures += 1
                checked += 1
            if len(got) != len(want):
                print(f"{tag}: {len(got)} scalars for {len(want)} {kind} records")
                failures += 1
    print(f"tb_read.py: {files[0]}: {len(tags)} tags, {checked} scalars checked against "
          f"metrics.jsonl, {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
