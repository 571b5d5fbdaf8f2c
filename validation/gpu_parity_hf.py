#!/usr/bin/env python3
"""Hugging Face parity of plm's bf16 CUDA training step (bench/gpu/gpu_parity_dump).

Loads the parameters, packed batch, loss and gradients that gpu_parity_dump wrote, runs the same
step with transformers' EsmForMaskedLM in fp32 (TF32 off) on the sequences padded into a batch,
and compares: the loss (sum of masked-token cross-entropy) and every parameter gradient by
||plm - hf|| / ||hf||.  bf16 compute bounds the agreement: pass = loss within 1% and every
gradient within 10% (the whole gradient vector within 5%).

  python3 validation/gpu_parity_hf.py DIR
"""
import sys

import numpy as np
import torch


def main(d):
    meta = {}
    tensors = []
    for line in open(f"{d}/meta.txt"):
        w = line.split()
        if w[0] == "tensor":
            tensors.append((w[1], int(w[2]), [int(x) for x in w[3:]]))
        else:
            meta[w[0]] = float(w[1])
    params = np.fromfile(f"{d}/params.bin", dtype=np.float32)
    grads = np.fromfile(f"{d}/grads.bin", dtype=np.float32)
    b = np.fromfile(f"{d}/batch.bin", dtype=np.int32)
    T, n = int(b[0]), int(b[1])
    tokens, labels, cu = b[2:2 + T], b[2 + T:2 + 2 * T], b[2 + 2 * T:3 + 2 * T + n]

    from transformers import EsmConfig, EsmForMaskedLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = EsmConfig(vocab_size=33, hidden_size=int(meta["hidden"]),
                    num_hidden_layers=int(meta["layers"]),
                    num_attention_heads=int(meta["heads"]), intermediate_size=int(meta["ffn"]),
                    max_position_embeddings=1026, position_embedding_type="rotary",
                    token_dropout=True, mask_token_id=32, pad_token_id=1, layer_norm_eps=1e-5,
                    emb_layer_norm_before=False, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    model = EsmForMaskedLM(cfg).cuda().float().train()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, off, shape in tensors:
            size = int(np.prod(shape))
            named[name].copy_(torch.from_numpy(params[off:off + size].reshape(shape)))
    lens = np.diff(cu)
    L = int(lens.max())
    ids = torch.full((n, L), 1, dtype=torch.long)
    lab = torch.full((n, L), -100, dtype=torch.long)
    mask = torch.zeros((n, L), dtype=torch.long)
    for s in range(n):
        a, e = int(cu[s]), int(cu[s + 1])
        ids[s, :e - a] = torch.from_numpy(tokens[a:e].astype(np.int64))
        lab[s, :e - a] = torch.from_numpy(labels[a:e].astype(np.int64))
        mask[s, :e - a] = 1
    ids, lab, mask = ids.cuda(), lab.cuda(), mask.cuda()
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    loss_sum = torch.nn.functional.cross_entropy(logits.view(-1, 33), lab.view(-1),
                                                 ignore_index=-100, reduction="sum")
    (loss_sum * meta["grad_scale"]).backward()

    ok = True
    loss_err = abs(meta["loss_sum"] - loss_sum.item()) / abs(loss_sum.item())
    print(f"loss sum: plm bf16 {meta['loss_sum']:.5f}  hf fp32 {loss_sum.item():.5f}  "
          f"rel {loss_err:.2e}")
    ok &= loss_err < 1e-2
    num = den = 0.0
    worst = []
    for name, off, shape in tensors:
        size = int(np.prod(shape))
        ref = named[name].grad.detach().cpu().numpy().reshape(-1).astype(np.float64)
        got = grads[off:off + size].astype(np.float64)
        e = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        num += np.sum((got - ref) ** 2)
        den += np.sum(ref ** 2)
        worst.append((e, name))
        ok &= bool(e < 0.10)
    worst.sort(reverse=True)
    total = (num / den) ** 0.5
    print(f"all gradients: rel {total:.2e}; worst tensors: " +
          ", ".join(f"{n_} {e:.2e}" for e, n_ in worst[:4]))
    ok &= total < 5e-2
    print("HF PARITY", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
