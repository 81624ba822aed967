"""Compares two GGUF files tensor by tensor, each dequantised by the vendored gguf-py.

Used to check the torch-free writer's quantised output (docs/ORACLE_LLAMACPP.md): the MXFP4 /
BF16 GGUF of a checkpoint must hold exactly the values of its F32 GGUF (the experts as the
exact dequantisation of the checkpoint's MXFP4, the BF16 trunk widened), under gguf-py's own
MXFP4 and BF16 decoders. Needs numpy only. Exits 1 if any name, shape or value differs.

usage: gguf_compare.py --llama-cpp DIR A.gguf B.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(args.llama_cpp.resolve() / "gguf-py"))
    import numpy as np
    import gguf
    from gguf.quants import dequantize

    a = {t.name: t for t in gguf.GGUFReader(args.a).tensors}
    b = {t.name: t for t in gguf.GGUFReader(args.b).tensors}
    bad = sorted(set(a) ^ set(b))
    for name in bad:
        print(f"{name}: only in {'a' if name in a else 'b'}")
    worst = 0.0
    types: dict[str, int] = {}
    for name in sorted(set(a) & set(b)):
        ta, tb = a[name], b[name]
        key = f"{ta.tensor_type.name} vs {tb.tensor_type.name}"
        types[key] = types.get(key, 0) + 1
        if list(ta.shape) != list(tb.shape):
            print(f"{name}: shape {list(ta.shape)} vs {list(tb.shape)}")
            bad.append(name)
            continue
        x = dequantize(ta.data, ta.tensor_type).astype(np.float32).ravel()
        y = dequantize(tb.data, tb.tensor_type).astype(np.float32).ravel()
        diff = float(np.abs(x - y).max()) if x.size else 0.0
        if diff > 0 or np.isnan(x).any() != np.isnan(y).any():
            print(f"{name}: max |a - b| {diff}")
            bad.append(name)
        worst = max(worst, diff)
    print(f"{len(a)} tensors in a, {len(b)} in b; types {types}; worst |a - b| {worst}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
