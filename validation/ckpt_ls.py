#!/usr/bin/env python3
"""List a plm checkpoint (or plm model file) with h5py alone, without plm.

    python3 validation/ckpt_ls.py CHECKPOINT.h5            groups, tensors (shape, dtype), attributes
    python3 validation/ckpt_ls.py --verify CHECKPOINT.h5   also recompute every tensor's crc32
    python3 validation/ckpt_ls.py --deck CHECKPOINT.h5     print the resolved deck it was trained with
    python3 validation/ckpt_ls.py --diff A.h5 B.h5         every tensor that differs between two
                                                           checkpoints (largest |a - b|, how many)

The layout is described in doc/checkpoints.md.  Exit status: 0 fine, 1 a check failed
(--verify: a checksum differs, a group is missing or the save was never completed),
2 usage (--diff: 1 when a tensor differs), 77 h5py is not installed (the ctest treats that as skipped).
"""
import argparse
import signal
import sys
import zlib

try:
    import h5py
    import numpy as np
except ImportError as e:  # pragma: no cover
    print(f"ckpt_ls.py: needs h5py and numpy ({e}); pip install h5py", file=sys.stderr)
    sys.exit(77)


def text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.ndarray):
        return "[" + ", ".join(text(v) for v in value.tolist()) + "]"
    return str(value)


def attributes(obj, indent, skip=()):
    for key in sorted(obj.attrs):
        if key in skip:
            continue
        value = text(obj.attrs[key])
        if "\n" in value:
            value = f"<{value.count(chr(10))} lines; --deck prints it>"
        print(f"{indent}@{key} = {value}")


def diff(path_a, path_b):
    """Prints every dataset of A that B lacks or holds other values in; 1 if any, else 0."""
    differing = []
    with h5py.File(path_a, "r") as a, h5py.File(path_b, "r") as b:
        def visit(name, obj):
            if not isinstance(obj, h5py.Dataset):
                return
            if name not in b:
                differing.append(f"/{name}: only in {path_a}")
                return
            x, y = obj[...], b[name][...]
            if x.shape != y.shape:
                differing.append(f"/{name}: shape {x.shape} vs {y.shape}")
                return
            x = np.asarray(x, dtype=np.float64) if x.dtype.kind in "fiu" else x
            y = np.asarray(y, dtype=np.float64) if y.dtype.kind in "fiu" else y
            if x.dtype.kind != "f":
                if not np.array_equal(x, y):
                    differing.append(f"/{name}: differs")
                return
            ne = ~((x == y) | (np.isnan(x) & np.isnan(y)))
            if ne.any():
                d = np.abs(x - y)[ne]
                differing.append(f"/{name}: {int(ne.sum())} of {x.size} values differ, largest "
                                 f"|a - b| {d.max():.3g} (|a| up to {np.abs(x).max():.3g})")
        a.visititems(visit)
    for line in differing:
        print(line)
    print(f"diff: {len(differing)} tensors differ" if differing else "diff: identical")
    return 1 if differing else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("other", nargs="?", help="with --diff: the checkpoint to compare with")
    parser.add_argument("--diff", action="store_true", help="list the tensors that differ from OTHER")
    parser.add_argument("--verify", action="store_true", help="recompute the crc32 of every tensor")
    parser.add_argument("--deck", action="store_true", help="print the stored resolved deck and exit")
    args = parser.parse_args()
    if args.diff:
        if not args.other:
            parser.error("--diff needs two files")
        return diff(args.file, args.other)

    problems = []
    with h5py.File(args.file, "r") as f:
        if args.deck:
            if "state" not in f or "deck" not in f["state"].attrs:
                print(f"{args.file}: no /state deck attribute (not a plm checkpoint)", file=sys.stderr)
                return 1
            print(text(f["state"].attrs["deck"]), end="")
            return 0

        print(f"{args.file}")
        attributes(f, "  ")
        state = f.get("state")
        if state is None:
            print("  (no /state: a plm model file, not a checkpoint)")
        elif state.attrs.get("format") is None:
            problems.append("/state has no `format` attribute: the save was interrupted")
        total_bytes = 0
        verified = 0

        def visit(name, obj):
            nonlocal total_bytes, verified
            depth = name.count("/") + 1
            indent = "  " * depth
            if isinstance(obj, h5py.Group):
                print(f"{indent}/{name}/")
                attributes(obj, indent + "  ")
                return
            total_bytes += obj.size * obj.dtype.itemsize
            line = f"{indent}/{name}  {obj.dtype} {tuple(obj.shape)}"
            if args.verify and "crc32" in obj.attrs:
                data = np.ascontiguousarray(obj[...], dtype=obj.dtype.newbyteorder("<"))
                crc = zlib.crc32(data.tobytes()) & 0xFFFFFFFF
                stored = int(obj.attrs["crc32"])
                ok = crc == stored
                verified += 1
                line += "  crc32 ok" if ok else f"  crc32 MISMATCH (stored {stored}, computed {crc})"
                if not ok:
                    problems.append(f"/{name}: checksum mismatch")
            elif args.verify and state is not None and name.split("/")[0] in ("model", "optimizer"):
                problems.append(f"/{name}: no crc32 attribute")  # model files carry none
            print(line)

        f.visititems(visit)
        if state is not None:
            # The optimizer's state groups (doc/optimizers.md): listed in /optimizer's `state`
            # attribute; files from before optimizer.name hold AdamW's two moments.
            opt = f.get("optimizer")
            names = ["exp_avg", "exp_avg_sq"]
            if opt is not None and "state" in opt.attrs:
                text = opt.attrs["state"]
                text = text.decode() if isinstance(text, bytes) else str(text)
                names = [n for n in text.split(",") if n]
            for group in ["model", "scaling"] + ["optimizer/" + n for n in names]:
                if group not in f:
                    problems.append(f"/{group} is missing")
            # Elementwise state over every tensor carries /model's names (AdamW, Lion).
            if "model" in f and "optimizer/exp_avg" in f and opt is not None and \
                    opt.attrs.get("kind", b"adamw") in ("adamw", "lion", b"adamw", b"lion") and \
                    set(f["model"]) != set(f["optimizer/exp_avg"]):
                problems.append("/model and /optimizer/exp_avg hold different tensor names")
        print(f"  tensor data: {total_bytes / 1e6:.1f} MB")

    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    if args.verify and not problems:
        print(f"verify: {verified} tensors match their crc32" if verified else "verify: no checksums (a model file)")
    return 1 if problems else 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `ckpt_ls.py FILE | head` ends quietly
    sys.exit(main())
