#!/usr/bin/env python3
"""Attention forward + backward of other implementations on the shapes plm's bench_gpu times.

The reference point for plm's own tensor-core flash attention (src/gpu/flash_attention.cu,
`bench_gpu`'s "attn" rows): PyTorch's scaled_dot_product_attention with each backend it has on
this machine -- cuDNN's fused attention (the same cuDNN 9 library the cudnn-frontend C++ graphs
call), FlashAttention-2 and the memory-efficient kernel -- in bf16, non-causal, 20 heads x 64 like
ESM-2 650M.  Dense: 16 sequences of 1024 (bench_gpu's "dense16x1024").  Varlen: the same number of
packed sequences with ESM-2's length distribution, as a jagged nested tensor (backends that do
not take one are reported as such).  Medians of CUDA-event timings after warm-up.

    python3 validation/bench_sdpa.py [--out sdpa.json]
"""
import argparse
import json
import math
import random

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup=5, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def bench(q, k, v, backend, flops_fwd):
    def fwd():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    o = fwd()
    g = torch.randn_like(o).detach()  # jagged outputs keep their nested shape

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        out = fwd()
        out.backward(g)

    f = timed(fwd)
    fb = timed(fwd_bwd)
    return {"fwd_ms": f, "fwd_bwd_ms": fb, "bwd_ms": fb - f,
            "fwd_tflops": flops_fwd / f / 1e9, "fwd_bwd_tflops": 3.5 * flops_fwd / fb / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    heads, dim = 20, 64
    results = []
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash2": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")

    # Dense 16 x 1024.
    b, s = 16, 1024
    flops = 4.0 * b * heads * s * s * dim
    for name, be in backends.items():
        q, k, v = (torch.randn(b, heads, s, dim, device=dev, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        try:
            r = bench(q, k, v, be, flops)
        except Exception as e:  # a backend that refuses the shape
            r = {"error": str(e).splitlines()[0][:160]}
        r.update({"case": "dense16x1024", "backend": name})
        results.append(r)
        print(json.dumps(r))

    # Varlen: 64 ESM-2-like lengths as a jagged nested tensor.
    rng = random.Random(2026)
    lengths = [min(1024, max(30, round(math.exp(rng.gauss(0, 1) * 0.7 + math.log(300)))))
               for _ in range(64)]
    flops = sum(4.0 * heads * l * l * dim for l in lengths)
    for name, be in backends.items():
        try:
            # (B, j, H, D) jagged -> (B, H, j, D) as SDPA wants
            qn, kn, vn = (torch.nested.nested_tensor(
                [torch.randn(l, heads, dim, device=dev, dtype=torch.bfloat16) for l in lengths],
                layout=torch.jagged, requires_grad=True) for _ in range(3))
            q, k, v = (t.transpose(1, 2) for t in (qn, kn, vn))
            r = bench(q, k, v, be, flops)
        except Exception as e:
            r = {"error": str(e).splitlines()[0][:160]}
        r.update({"case": f"varlen{len(lengths)}x{sum(lengths)}tok", "backend": name})
        results.append(r)
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
