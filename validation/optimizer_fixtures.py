#!/usr/bin/env python3
"""Fixtures of the optimizers' published implementations for test_train_optimizer_fixtures.

Writes JSON with random starting parameters, 5 steps of random gradients and learning rates, and
the parameters each reference implementation reaches, for
  - adamw:     torch.optim.AdamW (betas 0.9/0.98, eps 1e-8, weight decay 0.01 on the matrix);
  - lion:      the authors' reference code (google/automl lion_pytorch.py, its step copied below);
  - adafactor: transformers.optimization.Adafactor(lr=..., relative_step=False,
               scale_parameter=True, warmup_init=False) when transformers is installed
               (torch.optim.Adafactor places eps1 differently and has no parameter-scaling
               switch, so it is not the rule plm implements).
The C++ test replays the same inputs through plm's optimizers (doc/optimizers.md) and compares.
A weight-decayed (6, 4) matrix and an undecayed bias of 4, as plm's decay mask would have them.

    python3 validation/optimizer_fixtures.py --out test/train/data/optimizer_fixtures.json

Needs torch (CPU is enough). Exit status 2 when torch is missing.
"""
import argparse
import json
import sys


def lion_step(p, grad, exp_avg, lr, wd, beta1, beta2):
    # google/automl lion/lion_pytorch.py, Lion.step for one parameter.
    p.data.mul_(1 - lr * wd)
    update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
    p.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="test/train/data/optimizer_fixtures.json")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("optimizer_fixtures: torch is missing (pip install torch); no fixtures written",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shapes = {"w": (6, 4), "b": (4,)}
    decay = {"w": True, "b": False}
    p0 = {k: torch.randn(s, dtype=torch.float32) * 0.5 for k, s in shapes.items()}
    grads = [{k: torch.randn(s, dtype=torch.float32) for k, s in shapes.items()} for _ in range(5)]
    lrs = [1e-2 * (i + 1) for i in range(5)]
    out = {"tensors": [{"name": k, "shape": list(s), "decay": decay[k]} for k, s in shapes.items()],
           "params0": {k: v.flatten().tolist() for k, v in p0.items()},
           "grads": [{k: v.flatten().tolist() for k, v in g.items()} for g in grads],
           "lrs": lrs, "cases": []}

    def run(make_opt, kind, options):
        params = {k: v.clone().requires_grad_(True) for k, v in p0.items()}
        opt = make_opt(params)
        for g, lr in zip(grads, lrs):
            for k in params:
                params[k].grad = g[k].clone()
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        out["cases"].append({"kind": kind, "options": options,
                             "params": {k: v.detach().flatten().tolist() for k, v in params.items()}})

    def groups(params, wd):
        return [{"params": [params[k] for k in params if decay[k]], "weight_decay": wd},
                {"params": [params[k] for k in params if not decay[k]], "weight_decay": 0.0}]

    run(lambda p: torch.optim.AdamW(groups(p, 0.01), lr=1e-3, betas=(0.9, 0.98), eps=1e-8),
        "adamw", {"beta1": 0.9, "beta2": 0.98, "eps": 1e-8, "weight_decay": 0.01})

    # Lion: the reference step by hand (lion_pytorch is not on PyPI).
    params = {k: v.clone() for k, v in p0.items()}
    m = {k: torch.zeros_like(v) for k, v in p0.items()}
    for g, lr in zip(grads, lrs):
        for k in params:
            lion_step(params[k], g[k], m[k], lr, 0.1 if decay[k] else 0.0, 0.9, 0.99)
    out["cases"].append({"kind": "lion", "options": {"beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1},
                         "params": {k: v.flatten().tolist() for k, v in params.items()}})
    try:
        from transformers.optimization import Adafactor
        run(lambda p: Adafactor(groups(p, 0.01), lr=1e-2, relative_step=False, scale_parameter=True,
                                warmup_init=False), "adafactor",
            {"eps1": 1e-30, "eps2": 1e-3, "clip_threshold": 1.0, "decay_rate": -0.8,
             "weight_decay": 0.01, "scale_parameter": True})
    except ImportError:
        print("optimizer_fixtures: transformers is missing; no Adafactor case", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote %s (%s)" % (args.out, ", ".join(c["kind"] for c in out["cases"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
