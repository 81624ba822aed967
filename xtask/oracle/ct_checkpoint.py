"""Rebuilds a synthetic K3 checkpoint with routed experts packed by compressed-tensors.

Input: a checkpoint our own generator wrote (config.json, shards, index). Output: one
`model.safetensors` with every tensor of that checkpoint, same names, dtypes and shapes, in
lexicographic name order like the release, except that each routed expert's six tensors are
replaced by what compressed-tensors' MXFP4 path (calculate_qparams, then the compressor that
the config's `quantization_config` format selects: MXFP4PackedCompressor.compress) makes of
fresh random bf16 weights; and `expected.json` with every expert matrix decoded to f32 by
ml_dtypes. Our loader must accept the file and our decoder must reproduce the decode bit for bit.

Run it through `cargo xtask oracle-ct-checkpoint`, which installs exact pins in a venv; nothing
here runs in `cargo test`. The safetensors file is written by hand (the package's writer orders
data by dtype first, the release by name) and then read back with the safetensors package.
"""

import argparse
import importlib.metadata
import json
import math
import platform
import re
import struct
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open

from splitmix import SplitMix64

# Shared with the decode oracle, so both fixtures quantise, decode and cross-check one way.
from mxfp4_oracle import (
    GROUP,
    check_decode,
    decode_ml_dtypes,
    quantize_with_compressed_tensors,
)

PACKAGES = ["compressed-tensors", "ml-dtypes", "safetensors", "torch", "numpy"]
EXPERT_TENSOR = re.compile(
    r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\."
    r"(w[123])\.(weight_packed|weight_scale)$"
)
TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}


def read_safetensors(path):
    """name -> (dtype, shape, raw bytes), parsed by hand from one file."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        tensors[name] = (info["dtype"], list(info["shape"]), data[start + begin : start + end])
    return tensors


def read_checkpoint(directory):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        for name, entry in read_safetensors(directory / shard).items():
            assert index["weight_map"].get(name) == shard, f"{name} is not indexed to {shard}"
            assert name not in tensors, f"{name} stored twice"
            tensors[name] = entry
    assert len(tensors) == len(index["weight_map"]), "the index names tensors no shard holds"
    return tensors


def write_safetensors(path, tensors):
    """The release's layout: data in lexicographic name order, back to back, the JSON header
    padded with spaces to a multiple of 8 bytes."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        dtype, shape, data = tensors[name]
        end = offset + len(data)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(tensors[name][2])


def check_with_safetensors(path, tensors):
    """Reads the file back with the safetensors package: every tensor, its dtype, shape, bytes."""
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}, f"metadata {f.metadata()}"
        assert sorted(f.keys()) == sorted(tensors), "safetensors sees another set of tensors"
        for name, (dtype, shape, data) in tensors.items():
            tensor = f.get_tensor(name)
            assert tensor.dtype == TORCH_DTYPES[dtype], f"{name}: dtype {tensor.dtype}"
            assert list(tensor.shape) == shape, f"{name}: shape {list(tensor.shape)}"
            raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            assert raw == data, f"{name}: bytes differ when read back"


def random_expert_weight(rng, rows, cols):
    """bf16 weights with variance about 1/cols, like the generator's experts, each 32-group
    scaled by 2^-2..2^2 so several scale bytes occur; about 1 in 16 values an exact +-0, never
    an all-zero group (generate_mx_scales has no meaningful answer for one)."""
    bound = math.sqrt(3.0 / cols)
    weight = np.zeros((rows, cols), dtype=np.float32)
    for row in range(rows):
        for group in range(cols // GROUP):
            magnitude = bound * 2.0 ** (rng.below(5) - 2)
            values = [rng.signed_unit() * magnitude for _ in range(GROUP)]
            for i in range(GROUP):
                roll = rng.below(32)
                if roll == 0:
                    values[i] = 0.0
                elif roll == 1:
                    values[i] = -0.0
            if all(v == 0.0 for v in values):
                values[rng.below(GROUP)] = magnitude
            weight[row, group * GROUP : (group + 1) * GROUP] = values
    return torch.from_numpy(weight).to(torch.bfloat16)


def mxfp4_scheme(config):
    """The weight scheme and compressor the checkpoint's own quantization_config names."""
    text = config.get("text_config", config)
    quant = QuantizationConfig.model_validate(text["quantization_config"])
    assert quant.format == "mxfp4-pack-quantized", f"format {quant.format}"
    compressor = BaseCompressor.get_value_from_registry(quant.format)
    # The shared quantiser calls MXFP4PackedCompressor by name; it must be the registered one.
    assert compressor is MXFP4PackedCompressor, f"{quant.format} selects {compressor}"
    (scheme,) = quant.config_groups.values()
    return scheme


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synth", required=True, help="checkpoint written by our generator")
    parser.add_argument("--synth-options", required=True, help="json recorded as provenance")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--command", required=True, help="the command line to record")
    parser.add_argument("--out", required=True, help="directory to write into")
    args = parser.parse_args()

    synth = Path(args.synth)
    out = Path(args.out)
    config = json.loads((synth / "config.json").read_text())
    scheme = mxfp4_scheme(config)
    tensors = read_checkpoint(synth)

    matrices = {}
    for name, (dtype, shape, _) in tensors.items():
        found = EXPERT_TENSOR.match(name)
        if found:
            layer, expert, proj, part = found.groups()
            assert dtype == "U8", f"{name}: dtype {dtype}"
            matrices.setdefault((int(layer), int(expert), proj), {})[part] = shape
    assert matrices, "the checkpoint has no routed experts"

    rng = SplitMix64(args.seed)
    expected = []
    for layer, expert, proj in sorted(matrices):
        shapes = matrices[(layer, expert, proj)]
        rows, half = shapes["weight_packed"]
        cols = 2 * half
        assert shapes["weight_scale"] == [rows, cols // GROUP], f"scale shape {shapes}"
        base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"
        weight = random_expert_weight(rng, rows, cols)
        packed, scales = quantize_with_compressed_tensors(weight, scheme)
        _, decoded = decode_ml_dtypes(packed, scales, rows, cols)
        # ml_dtypes against compressed-tensors' own unpack and decompress and an f64 closed form.
        check_decode(base, packed, scales, rows, cols, scheme, decoded)
        # The quantiser really ran: every element lies within one scale step of its input.
        step = np.repeat(np.exp2(scales.astype(np.float64) - 127.0), GROUP, axis=1)
        error = np.abs(decoded.astype(np.float64) - weight.double().numpy())
        assert np.all(error <= step), f"{base}: quantisation error too big"
        assert np.all((scales != 0x00) & (scales != 0xFF)), f"{base}: a 0x00 or NaN scale byte"
        for part, array in (("weight_packed", packed), ("weight_scale", scales)):
            name = f"language_model.{base}.{part}"
            old_dtype, old_shape, old_bytes = tensors[name]
            assert list(array.shape) == old_shape, f"{name}: shape {array.shape} vs {old_shape}"
            tensors[name] = (old_dtype, old_shape, array.tobytes())
        expected.append(
            {
                "name": base,
                "layer": layer,
                "expert": expert,
                "proj": proj,
                "rows": rows,
                "cols": cols,
                "dequant_f32_bits": decoded.astype("<f4").tobytes().hex(),
            }
        )

    model = out / "model.safetensors"
    write_safetensors(model, tensors)
    check_with_safetensors(model, tensors)

    oracle = {
        "format": "k3 ct checkpoint fixture v1",
        "about": (
            "model.safetensors is our generator's checkpoint (synth) with every routed expert's "
            "weight_packed/weight_scale replaced by compressed-tensors' MXFP4 packing "
            "(calculate_qparams + MXFP4PackedCompressor.compress, scheme from config.json's "
            "quantization_config) of fresh random bf16 weights. matrices: each expert matrix, "
            "its logical [rows, cols], and dequant_f32_bits, little-endian f32 row-major, "
            "computed by ml_dtypes as f32(float4_e2m1fn(code)) * f32(float8_e8m0fnu(scale)); "
            "checked against compressed-tensors unpack_fp4_from_uint8 and decompress and an "
            "f64 closed form."
        ),
        "command": args.command,
        "script": "xtask/oracle/ct_checkpoint.py",
        "seed": args.seed,
        "synth": json.loads(args.synth_options),
        "python": platform.python_version(),
        "packages": {name: importlib.metadata.version(name) for name in PACKAGES},
        "matrices": expected,
    }
    with open(out / "expected.json", "w", encoding="utf-8") as f:
        json.dump(oracle, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
