#!/usr/bin/env python3
"""A plm task head exported with `plm convert --to-hf MODEL.h5 --head HEAD.h5` against plm.

Loads HF_DIR with transformers' EsmForSequenceClassification or EsmForTokenClassification (as
config.json's architectures say), runs the sequences of plm's <run_dir>/task_logits.tsv (id,
sequence, logits; written at the end of a task-head run) in eval mode, fp32, one at a time, and
prints the largest absolute difference between the two sets of logits, and per sequence.

usage: hf_head_parity.py HF_DIR TASK_LOGITS_TSV [--max N] [--tol T]
Needs torch and transformers (the GPU machine has them); exit 1 when the difference exceeds
--tol (default: no check).
"""
import argparse
import json
import os
import sys
import tempfile

import torch
import transformers


# ESM-2's 33 tokens in id order (facebook/esm2_t*'s vocab.txt), for a folder saved without its
# tokenizer (a model made by transformers' save_pretrained alone, as the GPU stages do offline).
ESM2_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I",
              "D", "P", "K", "Q", "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O",
              ".", "-", "<null_1>", "<mask>"]


def tokenizer(hf_dir):
    if os.path.exists(os.path.join(hf_dir, "vocab.txt")):
        return transformers.AutoTokenizer.from_pretrained(hf_dir)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(ESM2_VOCAB) + "\n")
    return transformers.EsmTokenizer(vocab_file=f.name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("tsv")
    ap.add_argument("--max", type=int, default=8)
    ap.add_argument("--tol", type=float, default=None)
    a = ap.parse_args()
    arch = json.load(open(f"{a.hf_dir}/config.json"))["architectures"][0]
    cls = getattr(transformers, arch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = cls.from_pretrained(a.hf_dir, torch_dtype=torch.float32).to(device).eval()
    tok = tokenizer(a.hf_dir)
    worst = 0.0
    scale = 0.0
    rows = [line.rstrip("\n").split("\t") for line in open(a.tsv) if line.strip()]
    for ident, seq, values in rows[: a.max]:
        plm = torch.tensor([float(v) for v in values.split()], dtype=torch.float64)
        with torch.no_grad():
            enc = tok([seq], return_tensors="pt").to(device)
            hf = model(**enc).logits[0].double().cpu().reshape(-1)
        if hf.numel() != plm.numel():
            print(f"{ident}: {hf.numel()} logits from transformers, {plm.numel()} from plm")
            return 1
        diff = (hf - plm).abs().max().item()
        worst = max(worst, diff)
        scale = max(scale, hf.abs().max().item())
        print(f"{ident} ({len(seq)} residues): max |logit diff| {diff:.3e} "
              f"(hf {hf[:3].tolist()} plm {plm[:3].tolist()})")
    print(f"{arch}: max abs logit difference {worst:.3e} over {min(a.max, len(rows))} "
          f"sequences (largest |logit| {scale:.3e})")
    if a.tol is not None and worst > a.tol:
        print(f"FAIL: above --tol {a.tol}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
