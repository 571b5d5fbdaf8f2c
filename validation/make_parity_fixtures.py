#!/usr/bin/env python3
"""Hugging Face parity fixtures for plm's ESM-2 (test/fixtures/esm_parity_*.h5).

Builds small random `transformers.EsmForMaskedLM` models exactly as doc/anchors.md §1 defines ESM-2
(33-token vocabulary, rotary, token dropout, pre-LN, no emb_layer_norm_before), runs them in
float64 (with the two float32 internals of transformers raised to float64, see
float64_internals) on a padded batch with an attention mask, and records what plm must reproduce on the
same batch in its packed (THD) form:

  attributes on `/`: script, transformers_version, torch_version, python_version, seed,
      num_layers, hidden, heads, ffn, vocab, max_positions, layer_norm_eps, token_dropout,
      reference_dtype = "float64", loss (mean cross-entropy over labels != -100), num_masked
  /params/<HF name>     float64, full HF shape (lm_head.decoder.weight is tied to
                        esm.embeddings.word_embeddings.weight and not stored separately)
  /grads/<HF name>      float64, d loss / d param of HF's *mean* loss; the embedding's gradient
                        includes both the input lookup and the tied decoder path
  /batch/tokens         int32 (T)    packed tokens after MLM corruption (<cls> ... <eos> per sequence)
  /batch/labels         int32 (T)    original token at selected positions, -100 elsewhere
  /batch/cu_seqlens     int32 (n+1)
  /logits               float64 (T, 33) logits at the real (unpadded) tokens, packed order
  /last_hidden_state    float64 (T, H)  output of emb_layer_norm_after, packed order
  /embed/tokens, /embed/cu_seqlens      the same sequences, unmasked (what `plm embed` sees)
  /embed/logits         float64 (T, 33) logits of the unmasked input
  /embed/embeddings     float64 (n, H)  mean of last_hidden_state over residues (<cls>/<eos> excluded)

Usage: python3 validation/make_parity_fixtures.py [--out-dir test/fixtures]
Requires: validation/requirements.txt (torch, transformers, h5py).
"""

import argparse
import os
import platform
import types
import sys

import h5py
import numpy as np
import torch
import transformers
from transformers import EsmConfig, EsmForMaskedLM
from transformers.models.esm import modeling_esm

# doc/anchors.md §1 vocabulary.
CLS, PAD, EOS, MASK = 0, 1, 2, 32
VOCAB = 33
FIRST_RESIDUE, LAST_STANDARD_AA, LAST_RESIDUE = 4, 23, 28

# name -> (layers, hidden, heads, ffn, residues per sequence, seed)
SHAPES = {
    "small": (2, 16, 2, 32, [9, 14, 6], 11),
    "multihead": (3, 32, 4, 64, [4, 21, 13, 30, 8], 23),
}


def make_config(layers, hidden, heads, ffn):
    return EsmConfig(
        vocab_size=VOCAB,
        pad_token_id=PAD,
        mask_token_id=MASK,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=1026,
        layer_norm_eps=1e-5,
        position_embedding_type="rotary",
        emb_layer_norm_before=False,
        token_dropout=True,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )


def randomize(model, generator):
    """Nonzero weights, biases and LayerNorm parameters, so every term of the model matters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            if "LayerNorm" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "word_embeddings" in name:
                p.copy_(0.3 * noise)
            else:  # Linear weights (out, in): keep activations O(1)
                p.copy_(noise * (1.0 / np.sqrt(p.shape[1])))


STOCK_APPLY_ROTARY = modeling_esm.apply_rotary_pos_emb


def float64_internals(model):
    """transformers computes three small things in float32 even in a float64 model: the rotary
    cos/sin table, the rotation itself (apply_rotary_pos_emb casts q and k to float32) and token
    dropout's mask ratio. Patch them to float64 (same formulas) so the
    reference is float64 throughout and plm's double build can be held to ~1e-12. build() checks
    that the patched model agrees with the unpatched one to float32 rounding."""

    def rotary(self, x, position_ids, layer_type=None):
        dim = self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def embeddings(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        assert self.token_dropout and self.layer_norm is None and attention_mask is not None
        x = self.word_embeddings(input_ids)
        is_mask = input_ids == self.mask_token_id
        x = x.masked_fill(is_mask.unsqueeze(-1), 0.0)
        ratio = is_mask.sum(-1).to(torch.float64) / attention_mask.sum(-1).to(torch.float64)
        x = x * (1 - 0.15 * 0.8) / (1 - ratio)[:, None, None]
        return x * attention_mask.unsqueeze(-1).to(x.dtype)

    def apply_rotary(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        rotate = modeling_esm.rotate_half
        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    modeling_esm.apply_rotary_pos_emb = apply_rotary
    model.esm.rotary_embeddings.forward = types.MethodType(rotary, model.esm.rotary_embeddings)
    model.esm.embeddings.forward = types.MethodType(embeddings, model.esm.embeddings)


def make_batch(residue_counts, rng):
    """Sequences as <cls> + residues + <eos>; MLM corruption per doc/anchors.md §1, with at least
    one <mask> per sequence so token dropout's per-sequence rescaling is exercised."""
    clean, corrupted, labels = [], [], []
    for n in residue_counts:
        # Mostly the 20 standard amino acids, plus rare letters (X, B, U, Z, O) now and then.
        residues = rng.integers(FIRST_RESIDUE, LAST_STANDARD_AA + 1, size=n)
        rare = rng.random(n) < 0.1
        residues[rare] = rng.integers(LAST_STANDARD_AA + 1, LAST_RESIDUE + 1, size=rare.sum())
        seq = np.concatenate([[CLS], residues, [EOS]]).astype(np.int64)
        tok = seq.copy()
        lab = np.full_like(seq, -100)
        selected = rng.random(n) < 0.15
        # Force one selected position that becomes <mask>.
        forced = rng.integers(0, n)
        selected[forced] = True
        for i in np.nonzero(selected)[0]:
            pos = i + 1
            lab[pos] = seq[pos]
            r = rng.random()
            if i == forced or r < 0.8:
                tok[pos] = MASK
            elif r < 0.9:
                tok[pos] = rng.integers(FIRST_RESIDUE, LAST_STANDARD_AA + 1)
        clean.append(seq)
        corrupted.append(tok)
        labels.append(lab)
    return clean, corrupted, labels


def pad(seqs, value):
    width = max(len(s) for s in seqs)
    out = np.full((len(seqs), width), value, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return torch.from_numpy(out)


def attention_mask(seqs):
    width = max(len(s) for s in seqs)
    m = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        m[i, : len(s)] = 1
    return torch.from_numpy(m)


def packed(padded, seqs):
    """(B, L, ...) padded tensor -> (T, ...) numpy at the real tokens, sequence after sequence."""
    return np.concatenate([padded[i, : len(s)].detach().numpy() for i, s in enumerate(seqs)], axis=0)


def run(model, seqs, labels=None):
    ids = pad(seqs, PAD)
    mask = attention_mask(seqs)
    lab = pad(labels, -100) if labels is not None else None
    out = model(input_ids=ids, attention_mask=mask, labels=lab, output_hidden_states=True)
    return out


def build(name, out_dir):
    modeling_esm.apply_rotary_pos_emb = STOCK_APPLY_ROTARY
    layers, hidden, heads, ffn, residue_counts, seed = SHAPES[name]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    config = make_config(layers, hidden, heads, ffn)
    model = EsmForMaskedLM(config).double().eval()
    randomize(model, generator)

    clean, corrupted, labels = make_batch(residue_counts, rng)
    cu_seqlens = np.concatenate([[0], np.cumsum([len(s) for s in clean])]).astype(np.int32)

    with torch.no_grad():
        stock = run(model, corrupted, labels)
    float64_internals(model)

    # Masked batch: logits, loss and every gradient.
    out = run(model, corrupted, labels)
    stock_difference = ((out.logits - stock.logits).abs().max() / stock.logits.abs().max()).item()
    assert stock_difference < 1e-6, f"float64 patches changed the logits by {stock_difference}"
    model.zero_grad()
    out.loss.backward()
    params = {n: p for n, p in model.named_parameters() if not n.startswith("esm.contact_head.")}
    assert "lm_head.decoder.weight" not in params, "decoder weight should be tied (deduplicated)"
    assert model.lm_head.decoder.weight is model.esm.embeddings.word_embeddings.weight

    # Unmasked batch: what `plm embed` computes.
    with torch.no_grad():
        clean_out = run(model, clean)
    hidden_clean = clean_out.hidden_states[-1]  # after emb_layer_norm_after
    embeddings = np.stack(
        [hidden_clean[i, 1 : len(s) - 1].mean(dim=0).numpy() for i, s in enumerate(clean)]
    )

    # HF's hidden_states[-1] is the encoder output after emb_layer_norm_after; check it is
    # what last_hidden_state means here by recomputing the logits from it.
    with torch.no_grad():
        check = model.lm_head(out.hidden_states[-1])
    assert torch.allclose(check, out.logits, rtol=0, atol=1e-12), "hidden_states[-1] is not the LM head input"

    num_masked = int(sum((lab != -100).sum() for lab in labels))
    path = os.path.join(out_dir, f"esm_parity_{name}.h5")
    with h5py.File(path, "w") as f:
        a = f.attrs
        # Strings as fixed-length ASCII (np.bytes_): h5py's default variable-length UTF-8 strings
        # do not convert to the C-string type plm's HDF5 helpers read.
        a["script"] = np.bytes_("validation/make_parity_fixtures.py")
        a["transformers_version"] = np.bytes_(str(transformers.__version__))
        a["torch_version"] = np.bytes_(str(torch.__version__))
        a["python_version"] = np.bytes_(platform.python_version())
        a["seed"] = seed
        a["num_layers"], a["hidden"], a["heads"], a["ffn"] = layers, hidden, heads, ffn
        a["vocab"] = VOCAB
        a["max_positions"] = config.max_position_embeddings
        a["layer_norm_eps"] = config.layer_norm_eps
        a["token_dropout"] = 1
        a["reference_dtype"] = np.bytes_("float64")
        a["loss"] = float(out.loss.item())
        a["float64_patches"] = np.bytes_("rotary table, rotation and token-dropout ratio in float64 (see float64_internals)")
        a["stock_logits_difference"] = stock_difference
        a["num_masked"] = num_masked
        z = {}  # contiguous: for tensors this small, chunk indexes cost more than gzip saves
        for n, p in params.items():
            f.create_dataset(f"params/{n}", data=p.detach().numpy(), **z)
            f.create_dataset(f"grads/{n}", data=p.grad.detach().numpy(), **z)
        f.create_dataset("batch/tokens", data=np.concatenate(corrupted).astype(np.int32))
        f.create_dataset("batch/labels", data=np.concatenate(labels).astype(np.int32))
        f.create_dataset("batch/cu_seqlens", data=cu_seqlens)
        f.create_dataset("logits", data=packed(out.logits, corrupted), **z)
        f.create_dataset("last_hidden_state", data=packed(out.hidden_states[-1], corrupted), **z)
        f.create_dataset("embed/tokens", data=np.concatenate(clean).astype(np.int32))
        f.create_dataset("embed/cu_seqlens", data=cu_seqlens)
        f.create_dataset("embed/logits", data=packed(clean_out.logits, clean), **z)
        f.create_dataset("embed/embeddings", data=embeddings, **z)
    size = os.path.getsize(path)
    print(f"{path}: {len(params)} tensors, {sum(p.numel() for p in params.values())} parameters, "
          f"{len(clean)} sequences, {cu_seqlens[-1]} tokens, {num_masked} masked, loss {out.loss.item():.6f}, "
          f"{size} bytes")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default=os.path.join(here, "..", "test", "fixtures"))
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, python {sys.version.split()[0]}")
    for name in SHAPES:
        build(name, args.out_dir)


if __name__ == "__main__":
    main()
