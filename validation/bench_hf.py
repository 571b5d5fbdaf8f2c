#!/usr/bin/env python3
"""Hugging Face EsmForMaskedLM training throughput on one GPU, for the side-by-side table.

Same protocol as doc/anchors.md section 6: randomly initialised ESM-2 of each size, bf16
autocast, SDPA attention, fused AdamW; batches of 16 sequences padded to 1024 tokens whose
lengths (specials included) are exp(N(0,1)*0.7 + ln 300) clamped to [30, 1024], 15% of residues
masked; real (unpadded) tokens are counted.  Each configuration runs --steps steps and drops the
first --warmup; eager and torch.compile.  Prints a table and writes JSON (--out).

  python3 validation/bench_hf.py --models 8m,650m --compile 650m --out hf.json
"""
import argparse
import json
import math
import time

import torch

PRESETS = {  # layers, hidden, heads, ffn
    "8m": (6, 320, 20, 1280),
    "35m": (12, 480, 20, 1920),
    "150m": (30, 640, 20, 2560),
    "650m": (33, 1280, 20, 5120),
    "3b": (36, 2560, 40, 10240),
}
GEMM_CEILING_TFLOPS = 779.0  # measured BF16 cuBLASLt 8192^3 on the project's H100 (GPU.md)
PEAK_TFLOPS = 989.0


def draw_batch(gen, batch, seq_len, device):
    lens = torch.exp(torch.randn(batch, generator=gen) * 0.7 + math.log(300.0))
    lens = lens.round().clamp(30, seq_len).long()
    ids = torch.full((batch, seq_len), 1, dtype=torch.long)  # <pad>
    mask = torch.zeros((batch, seq_len), dtype=torch.long)
    labels = torch.full((batch, seq_len), -100, dtype=torch.long)
    for b, n in enumerate(lens.tolist()):
        res = torch.randint(4, 24, (n - 2,), generator=gen)
        ids[b, 0] = 0
        ids[b, 1 : n - 1] = res
        ids[b, n - 1] = 2
        mask[b, :n] = 1
        sel = torch.rand(n - 2, generator=gen) < 0.15
        pos = torch.nonzero(sel).flatten() + 1
        labels[b, pos] = ids[b, pos]
        ids[b, pos] = 32  # <mask>
    return ids.to(device), mask.to(device), labels.to(device), lens


def flops_per_token(layers, hidden, ffn, mean_weighted_len):
    matmul_params = layers * (4 * hidden * hidden + 2 * hidden * ffn) + hidden * hidden + 33 * hidden
    attention = 12.0 * layers * hidden * mean_weighted_len  # QK^T and PV, forward + backward
    return 6.0 * matmul_params + attention


def run(name, compile_model, steps, warmup, batch, seq_len, device):
    from transformers import EsmConfig, EsmForMaskedLM

    layers, hidden, heads, ffn = PRESETS[name]
    cfg = EsmConfig(vocab_size=33, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=ffn, max_position_embeddings=1026,
                    position_embedding_type="rotary", token_dropout=True, mask_token_id=32,
                    pad_token_id=1, layer_norm_eps=1e-5, emb_layer_norm_before=False,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    try:
        model = EsmForMaskedLM._from_config(cfg, attn_implementation="sdpa")
    except Exception:  # older/newer transformers without the keyword
        model = EsmForMaskedLM(cfg)
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4, betas=(0.9, 0.98), weight_decay=0.01,
                            fused=True)
    step_model = torch.compile(model) if compile_model else model
    gen = torch.Generator().manual_seed(1234)
    batches = [draw_batch(gen, batch, seq_len, device) for _ in range(4)]
    torch.cuda.reset_peak_memory_stats()
    times, real_tokens, sumsq, sumlen = [], [], 0.0, 0.0
    for i in range(steps):
        ids, mask, labels, lens = batches[i % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            real_tokens.append(int(lens.sum()))
            sumsq += float((lens.double() ** 2).sum())
            sumlen += float(lens.sum())
    tok_s = sum(real_tokens) / sum(times)
    fpt = flops_per_token(layers, hidden, ffn, sumsq / sumlen)
    tflops = tok_s * fpt / 1e12
    res = {
        "model": "esm2_" + name, "impl": "hf_compile" if compile_model else "hf_eager",
        "tokens_per_s": tok_s, "tflops": tflops, "mfu_gemm_ceiling": tflops / GEMM_CEILING_TFLOPS,
        "mfu_989": tflops / PEAK_TFLOPS, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "step_ms_median": 1e3 * sorted(times)[len(times) // 2], "loss": float(loss),
        "real_tokens_per_step": sum(real_tokens) / len(real_tokens),
        "padding_fraction": 1 - (sum(real_tokens) / len(real_tokens)) / (batch * seq_len),
        "flops_per_token": fpt,
    }
    del model, step_model, opt
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="8m,35m,150m,650m")
    ap.add_argument("--compile", default="8m,650m", help="models also run under torch.compile")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--out", default="bench_hf.json")
    args = ap.parse_args()
    import transformers
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    results = []
    compiled = set(filter(None, args.compile.split(",")))
    for name in filter(None, args.models.split(",")):
        for comp in ([False, True] if name in compiled else [False]):
            try:
                r = run(name, comp, args.steps, args.warmup, args.batch, args.seq_len, dev)
            except Exception as e:  # report and go on: one failure must not lose the rest
                r = {"model": "esm2_" + name, "impl": "hf_compile" if comp else "hf_eager",
                     "error": repr(e)[:300]}
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(f"\n{'model':<11}{'impl':<12}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU(779)':>9}"
          f"{'MFU(989)':>9}{'peak GiB':>9}")
    for r in results:
        if "error" in r:
            print(f"{r['model']:<11}{r['impl']:<12} error: {r['error'][:60]}")
            continue
        print(f"{r['model']:<11}{r['impl']:<12}{r['tokens_per_s']:>12,.0f}{r['tflops']:>9.1f}"
              f"{100 * r['mfu_gemm_ceiling']:>8.1f}%{100 * r['mfu_989']:>8.1f}%{r['peak_mem_gib']:>9.1f}")


if __name__ == "__main__":
    main()
