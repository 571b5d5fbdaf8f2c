#!/usr/bin/env python3
"""Round trip through transformers: HF -> plm -> HF, and plm's logits against HF's.

1. Builds a random EsmForMaskedLM (fp32) and saves it with save_pretrained (as the installed
   transformers writes it), plus a bfloat16 copy.
2. `plm convert --from-hf` both, `plm convert --to-hf` the fp32 one.
3. EsmForMaskedLM.from_pretrained on plm's output: no missing or unexpected keys, every
   parameter bit-identical to the original, identical logits.
4. The bf16 conversion holds exactly the bf16 values (widened to fp32).
5. `plm embed --logits` on a FASTA of the batch: logits and mean-pooled embeddings agree with
   transformers' (fp32, stock model) to 1e-5 relative.
6. The Hub-ready export: AutoTokenizer.from_pretrained on plm's folder tokenizes exactly as the
   ESM-2 vocabulary says; a sharded export (--max-shard-size) and a bf16 one (--dtype bf16) load
   with AutoModelForMaskedLM, the sharded one bit-identical, the bf16 one as the bf16 rounding.

Exit status: 0 pass, 1 fail, 77 skipped (torch/transformers/h5py not installed; ctest reads 77
as "skipped"). Usage: hf_roundtrip.py --plm build/plm [--workdir DIR]
"""

import argparse
import copy
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import h5py
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForMaskedLM, AutoTokenizer, EsmConfig, EsmForMaskedLM
except ImportError as e:  # CI has no torch: skip, do not fail
    print(f"hf_roundtrip: skipped ({e}); pip install -r validation/requirements.txt to run it")
    sys.exit(77)

LETTERS = "LAGVSERTIDPKQNFYMHWCXBUZO"  # token ids 4..28


def fail(message):
    print(f"hf_roundtrip: FAIL: {message}")
    sys.exit(1)


def plm(binary, *args):
    result = subprocess.run([binary, *args], capture_output=True, text=True)
    if result.returncode != 0:
        fail(f"`plm {' '.join(args)}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result.stdout + result.stderr


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--plm", required=True)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="plm_hf_roundtrip_")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    torch.manual_seed(5)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, work dir {work}")

    config = EsmConfig(vocab_size=33, pad_token_id=1, mask_token_id=32, hidden_size=24, num_hidden_layers=2,
                       num_attention_heads=3, intermediate_size=48, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, max_position_embeddings=1026, layer_norm_eps=1e-5,
                       position_embedding_type="rotary", emb_layer_norm_before=False, token_dropout=True,
                       attn_implementation="eager")
    a = EsmForMaskedLM(config).eval()
    with torch.no_grad():
        for name, p in a.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if p.dim() == 1 else 1.0 / np.sqrt(p.shape[-1])) +
                    (1.0 if ("norm" in name.lower() and name.endswith("weight")) else 0.0))
    dir_a, dir_bf16, dir_b = (os.path.join(work, d) for d in ("hf_a", "hf_a_bf16", "hf_b"))
    a.save_pretrained(dir_a)
    copy.deepcopy(a).to(torch.bfloat16).save_pretrained(dir_bf16)  # Module.to is in place

    h5_a, h5_bf16 = os.path.join(work, "a.h5"), os.path.join(work, "a_bf16.h5")
    print(plm(args.plm, "convert", "--from-hf", dir_a, "--out", h5_a).strip())
    plm(args.plm, "convert", "--from-hf", dir_bf16, "--out", h5_bf16)
    print(plm(args.plm, "convert", "--to-hf", h5_a, "--out", dir_b).strip())

    b, info = EsmForMaskedLM.from_pretrained(dir_b, output_loading_info=True, attn_implementation="eager")
    b.eval()
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            fail(f"from_pretrained({dir_b}) reports {kind}: {info[kind]}")
    sa, sb = a.state_dict(), b.state_dict()
    for name, tensor in sa.items():
        if name not in sb:
            fail(f"{name} missing after the round trip")
        if not torch.equal(tensor, sb[name]):
            fail(f"{name} differs after the round trip")
    print(f"round trip: all {len(sa)} state-dict entries bit-identical")

    # A batch of sequences of different lengths (unpadded: one forward per sequence).
    rng = np.random.default_rng(1)
    sequences = ["".join(LETTERS[i] for i in rng.integers(0, 20, size=n)) for n in (5, 17, 40, 9)]
    fasta = os.path.join(work, "seqs.fasta")
    with open(fasta, "w") as f:
        for i, s in enumerate(sequences):
            f.write(f">s{i}\n{s}\n")
    ref_logits, ref_embed = [], []
    with torch.no_grad():
        for s in sequences:
            ids = torch.tensor([[0] + [LETTERS.index(c) + 4 for c in s] + [2]])
            oa = a(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
            ob = b(input_ids=ids, attention_mask=torch.ones_like(ids))
            if not torch.equal(oa.logits, ob.logits):
                fail("logits of the round-tripped model differ")
            ref_logits.append(oa.logits[0].numpy())
            ref_embed.append(oa.hidden_states[-1][0, 1:-1].mean(0).numpy())
    print("round trip: logits identical")

    # A plm-native file (no /hf_extra: trained by plm, not converted): transformers loads it
    # with only the contact head (which plm does not have) newly initialised.
    h5_native, dir_native = os.path.join(work, "native.h5"), os.path.join(work, "hf_native")
    shutil.copy(h5_a, h5_native)
    with h5py.File(h5_native, "a") as f:
        del f["hf_extra"]
    plm(args.plm, "convert", "--to-hf", h5_native, "--out", dir_native)
    c, info = EsmForMaskedLM.from_pretrained(dir_native, output_loading_info=True, attn_implementation="eager")
    c.eval()
    if info["unexpected_keys"] or set(info["missing_keys"]) - {"esm.contact_head.regression.weight",
                                                                "esm.contact_head.regression.bias"}:
        fail(f"plm-native export: unexpected {info['unexpected_keys']}, missing {info['missing_keys']}")
    with torch.no_grad():
        ids = torch.tensor([[0, 5, 9, 13, 7, 2]])
        la, lc = a(input_ids=ids).logits, c(input_ids=ids).logits
    native_difference = float((la - lc).abs().max() / la.abs().max())
    if native_difference > 1e-5:
        fail(f"plm-native export changes the logits by {native_difference}")
    print(f"plm-native export: loads (contact head newly initialised), logits within {native_difference:.1e}")

    # bf16 import: exactly the bf16 values.
    with h5py.File(h5_bf16) as f:
        for name, tensor in sa.items():
            if name.startswith("esm.contact_head") or "inv_freq" in name or name == "lm_head.decoder.weight":
                continue
            want = tensor.to(torch.bfloat16).to(torch.float32).numpy()
            if not np.array_equal(f["model"][name][()], want):
                fail(f"bf16 import of {name} is not the bf16 value")
    print("bf16 import: exact")

    out = os.path.join(work, "embed.h5")
    plm(args.plm, "embed", "--checkpoint", h5_a, "--fasta", fasta, "--out", out, "--logits")
    with h5py.File(out) as f:
        logits, offsets, embeddings = f["logits"][()], f["offsets"][()], f["embeddings"][()]
    worst_logits = worst_embed = 0.0
    for i, (ref, emb) in enumerate(zip(ref_logits, ref_embed)):
        got = logits[offsets[i]:offsets[i + 1]]
        worst_logits = max(worst_logits, float(np.abs(got - ref).max() / np.abs(ref).max()))
        worst_embed = max(worst_embed, float(np.abs(embeddings[i] - emb).max() / np.abs(emb).max()))
    print(f"plm embed vs transformers (fp32): logits {worst_logits:.2e}, embeddings {worst_embed:.2e}")
    if worst_logits > 1e-5 or worst_embed > 1e-5:
        fail("plm embed disagrees with transformers beyond 1e-5")
    # The Hub-ready export: tokenizer, shards, bf16.
    tok = AutoTokenizer.from_pretrained(dir_b)
    for s in sequences:
        want = [0] + [LETTERS.index(c) + 4 for c in s] + [2]
        if tok(s)["input_ids"] != want:
            fail(f"AutoTokenizer on plm's export tokenizes {s} as {tok(s)['input_ids']}, not {want}")
    if tok.mask_token_id != 32 or tok.pad_token_id != 1:
        fail(f"AutoTokenizer on plm's export: mask {tok.mask_token_id}, pad {tok.pad_token_id}")
    print(f"tokenizer: {type(tok).__name__} from plm's export tokenizes as ESM-2")
    dir_sharded, dir_half = os.path.join(work, "hf_sharded"), os.path.join(work, "hf_bf16_export")
    plm(args.plm, "convert", "--to-hf", h5_a, "--out", dir_sharded, "--max-shard-size", "20KB")
    if not os.path.exists(os.path.join(dir_sharded, "model.safetensors.index.json")):
        fail("--max-shard-size 20KB wrote no model.safetensors.index.json")
    d, info = AutoModelForMaskedLM.from_pretrained(dir_sharded, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        fail(f"sharded export: missing {info['missing_keys']}, unexpected {info['unexpected_keys']}")
    for name, tensor in d.state_dict().items():
        if not torch.equal(tensor, sb[name]):
            fail(f"sharded export: {name} differs")
    plm(args.plm, "convert", "--to-hf", h5_a, "--out", dir_half, "--dtype", "bf16")
    e = AutoModelForMaskedLM.from_pretrained(dir_half)  # bf16 or fp32, by version: compared in fp32
    for name, tensor in e.state_dict().items():
        if "inv_freq" in name or name not in sa:
            continue
        if not torch.equal(tensor.to(torch.float32), sa[name].to(torch.bfloat16).to(torch.float32)):
            fail(f"bf16 export: {name} is not the bf16 rounding")
    print("export: sharded bit-identical, bf16 the bf16 rounding; both load with AutoModelForMaskedLM")

    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print("hf_roundtrip: PASS")


if __name__ == "__main__":
    main()
