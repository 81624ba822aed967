"""Freezes an MXFP4 decode oracle for the mxfp4-kernels tests from independent references.

compressed-tensors, the library that writes K3's `mxfp4-pack-quantized` experts, quantises and
packs; ml_dtypes decodes. Our Rust decoder must reproduce the decode bit for bit. Run it through
`cargo xtask oracle-mxfp4`, which installs exact pins of both packages in a venv; nothing here is
meant to run in `cargo test`.

The random weights come from a small splitmix64 generator written out below rather than from
numpy or torch, so that the frozen bytes depend on the seed and on the two pinned packages, not
on the random streams of whichever numpy and torch pip resolves.
"""

import argparse
import importlib.metadata
import json
import platform

import ml_dtypes
import numpy as np
import torch
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
    unpack_fp4_from_uint8,
)
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from splitmix import SplitMix64

GROUP = 32
# Every E8M0 byte except 0xFF, which is NaN and which our loader rejects.
VALID_SCALE_BYTES = 255
PACKAGES = ["ml-dtypes", "compressed-tensors", "torch", "numpy"]


# ---------------------------------------------------------------------------------------------
# The independent decode: nibbles split by hand, values and scales converted by ml_dtypes.


def unpack_codes(packed, rows, cols):
    """[rows, cols/2] bytes -> [rows, cols] codes; the low nibble holds the even column."""
    low = packed & 0x0F
    high = packed >> 4
    return np.stack([low, high], axis=-1).reshape(rows, cols)


def decode_ml_dtypes(packed, scales, rows, cols):
    codes = unpack_codes(packed, rows, cols)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    # f32 times f32: E2M1 x 2^k is exact unless it overflows (bytes 253/254 with |code| >= 4),
    # and then both sides produce the same IEEE infinity, which the oracle keeps.
    with np.errstate(over="ignore"):
        out = values * np.repeat(scale, GROUP, axis=1)
    assert out.dtype == np.float32
    return codes, out


def check_decode(name, packed, scales, rows, cols, scheme, decoded):
    """Cross-checks the ml_dtypes decode against compressed-tensors and a closed form."""
    codes = unpack_codes(packed, rows, cols)

    # compressed-tensors' own unpacking must see the same values in the same columns.
    ct_values = unpack_fp4_from_uint8(torch.from_numpy(packed), rows, cols, dtype=torch.float32)
    ml_values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert_same_bits(f"{name}: unpack_fp4_from_uint8 vs nibble split", ct_values.numpy(), ml_values)

    # Closed form in f64, where E2M1 x 2^(s-127) is always exact, then one rounding to f32
    # (exact, or overflow to inf): independent of ml_dtypes' own E8M0 conversion.
    magnitudes = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    value64 = magnitudes[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    scale64 = np.exp2(scales.astype(np.float64) - 127.0)
    with np.errstate(over="ignore"):
        closed = (value64 * np.repeat(scale64, GROUP, axis=1)).astype(np.float32)
    assert_same_bits(f"{name}: closed form vs ml_dtypes", closed, decoded)

    # compressed-tensors' decompress dequantises to bf16; every E2M1 x 2^k with k in
    # -127..127 is exact in bf16 too (subnormals included), so it must agree everywhere.
    state = {
        "weight_packed": torch.from_numpy(packed.copy()),
        "weight_scale": torch.from_numpy(scales.copy()),
    }
    weight = MXFP4PackedCompressor.decompress(state, scheme)["weight"]
    assert weight.shape == (rows, cols), f"{name}: decompress shape {tuple(weight.shape)}"
    assert_same_bits(f"{name}: decompress vs ml_dtypes", weight.float().numpy(), decoded)


def assert_same_bits(what, got, want):
    got = np.ascontiguousarray(got, dtype=np.float32).view(np.uint32)
    want = np.ascontiguousarray(want, dtype=np.float32).view(np.uint32)
    bad = np.argwhere(got != want)
    if len(bad):
        r, c = bad[0]
        raise AssertionError(
            f"{what}: {len(bad)} elements differ, first at row {r} col {c}: "
            f"{got[r, c]:#010x} vs {want[r, c]:#010x}"
        )


# ---------------------------------------------------------------------------------------------
# Tensors.


def quantize_with_compressed_tensors(weight, scheme):
    """The path a checkpoint takes: per-group min/max -> calculate_qparams (which calls
    generate_mx_scales) -> MXFP4PackedCompressor.compress (quantise, pack, E8M0 scales)."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // GROUP, GROUP)
    scale, _zero_point = calculate_qparams(
        groups.amin(dim=-1), groups.amax(dim=-1), scheme.weights
    )
    compressed = MXFP4PackedCompressor.compress(
        {"weight": weight, "weight_scale": scale}, scheme
    )
    packed = compressed["weight_packed"]
    scales = compressed["weight_scale"]
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (rows, cols // 2)
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == (rows, cols // GROUP)
    return packed.numpy().copy(), scales.numpy().copy()


def random_weight(rng, rows, cols, min_exp, max_exp):
    """Groups of mixed magnitude 2^k, each with some exact zeros and -0.0, never all zero:
    generate_mx_scales has no meaningful answer for an all-zero group."""
    weight = np.zeros((rows, cols), dtype=np.float32)
    for row in range(rows):
        for group in range(cols // GROUP):
            exp = min_exp + rng.below(max_exp - min_exp + 1)
            values = [rng.signed_unit() * 2.0**exp for _ in range(GROUP)]
            for i in range(GROUP):
                roll = rng.below(16)
                if roll == 0:
                    values[i] = 0.0
                elif roll == 1:
                    values[i] = -0.0
            if all(v == 0.0 for v in values):
                values[rng.below(GROUP)] = 2.0**exp
            weight[row, group * GROUP : (group + 1) * GROUP] = values
    return weight


def random_tensor(rng, scheme, name, rows, cols, dtype, special_groups):
    weight = random_weight(rng, rows, cols, -20, 20)
    exact = {}
    if special_groups:
        # An outlier group: one value 2^10 above the rest, so most codes round to +-0.
        weight[0, 0:GROUP] *= 2.0**-10
        weight[0, 5] = 3.0
        # A sparse group: a single non-zero element.
        weight[1, GROUP : 2 * GROUP] = 0.0
        weight[1, GROUP + 17] = -0.75
        # An exactly representable group: E2M1 values times 2^-3, which must quantise and
        # decode back to themselves.
        table = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
        codes = [rng.below(16) for _ in range(GROUP)]
        codes[0] = 7  # include 6.0 so the group max pins the scale at 2^-3
        weight[2, 0:GROUP] = table[codes] * 2.0**-3
        exact[(2, 0)] = weight[2, 0:GROUP].copy()
    tensor = torch.from_numpy(weight).to(dtype)
    packed, scales = quantize_with_compressed_tensors(tensor, scheme)
    codes, decoded = decode_ml_dtypes(packed, scales, rows, cols)

    # A sanity bound that the quantiser really ran: with power-of-two scales chosen so the
    # group max is at most 6 x scale, every element lies within one scale step of its input.
    original = tensor.float().numpy()
    scale_f32 = np.repeat(scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), GROUP, axis=1)
    assert np.all(np.abs(decoded - original) <= scale_f32), f"{name}: quantisation error too big"
    for (row, group), values in exact.items():
        # Compared as numbers: the quantiser may turn an input -0.0 into +0.0.
        got = decoded[row, group * GROUP : (group + 1) * GROUP]
        assert np.array_equal(got, values), f"{name}: exact group {group} of row {row} changed"
    assert np.all(scales != 0xFF), f"{name}: a NaN scale byte"

    return {
        "name": name,
        "source": (
            f"random {str(dtype).removeprefix('torch.')} weights quantised by compressed-tensors "
            "(calculate_qparams + MXFP4PackedCompressor.compress)"
        ),
        "rows": rows,
        "cols": cols,
        "packed": packed,
        "scales": scales,
        "codes": codes,
        "decoded": decoded,
    }


def all_codes_tensor(rng, scheme):
    """Every E2M1 code under every valid E8M0 byte: 255 groups, laid out 15 x 17 so groups
    also cross rows, each group holding every code twice in a seeded order. The bytes come
    from compressed-tensors' pack_fp4_to_uint8, so the nibble order is the package's."""
    rows, groups_per_row = 15, 17
    cols = groups_per_row * GROUP
    assert rows * groups_per_row == VALID_SCALE_BYTES
    codes = np.zeros((rows, cols), dtype=np.uint8)
    for group in range(VALID_SCALE_BYTES):
        order = list(range(16)) * 2
        for i in range(len(order) - 1, 0, -1):  # Fisher-Yates
            j = rng.below(i + 1)
            order[i], order[j] = order[j], order[i]
        row, col = divmod(group, groups_per_row)
        codes[row, col * GROUP : (col + 1) * GROUP] = order
    scales = np.arange(VALID_SCALE_BYTES, dtype=np.uint8).reshape(rows, groups_per_row)

    # E2M1 values of the codes, -0.0 for code 8: pack_fp4_to_uint8 reads the sign with signbit.
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    packed = pack_fp4_to_uint8(torch.from_numpy(values)).numpy().copy()
    assert packed.dtype == np.uint8 and packed.shape == (rows, cols // 2)
    unpacked, decoded = decode_ml_dtypes(packed, scales, rows, cols)
    if not np.array_equal(unpacked, codes):
        raise AssertionError("pack_fp4_to_uint8 does not put column 2b in the low nibble")
    return {
        "name": "all_codes_all_scales",
        "source": (
            "every E2M1 code under every E8M0 byte 0..254, packed by compressed-tensors "
            "pack_fp4_to_uint8"
        ),
        "rows": rows,
        "cols": cols,
        "packed": packed,
        "scales": scales,
        "codes": codes,
        "decoded": decoded,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--command", required=True, help="the command line to record")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    rng = SplitMix64(args.seed)
    tensors = [
        random_tensor(rng, scheme, "ct_random_f32_8x64", 8, 64, torch.float32, True),
        random_tensor(rng, scheme, "ct_random_bf16_4x256", 4, 256, torch.bfloat16, False),
        all_codes_tensor(rng, scheme),
    ]

    pairs = set()
    for t in tensors:
        check_decode(t["name"], t["packed"], t["scales"], t["rows"], t["cols"], scheme, t["decoded"])
        scale_per_col = np.repeat(t["scales"], GROUP, axis=1)
        pairs.update(zip(scale_per_col.ravel().tolist(), t["codes"].ravel().tolist()))
    assert len(pairs) == VALID_SCALE_BYTES * 16, f"only {len(pairs)} (scale, code) pairs"

    oracle = {
        "format": "k3 mxfp4 oracle v1",
        "about": (
            "MXFP4 (compressed-tensors mxfp4-pack-quantized layout) tensors and their exact f32 "
            "decode. weight_packed: [rows, cols/2] bytes, low nibble = even column; "
            "weight_scale: [rows, cols/32] E8M0 bytes; dequant_f32_bits: little-endian f32, "
            "row-major [rows, cols], computed by ml_dtypes as f32(float4_e2m1fn(code)) * "
            "f32(float8_e8m0fnu(scale)). Checked against compressed-tensors "
            "unpack_fp4_from_uint8 and MXFP4PackedCompressor.decompress, and an f64 closed form."
        ),
        "command": args.command,
        "script": "xtask/oracle/mxfp4_oracle.py",
        "seed": args.seed,
        "python": platform.python_version(),
        "packages": {name: importlib.metadata.version(name) for name in PACKAGES},
        "tensors": [
            {
                "name": t["name"],
                "source": t["source"],
                "rows": t["rows"],
                "cols": t["cols"],
                "weight_packed": t["packed"].tobytes().hex(),
                "weight_scale": t["scales"].tobytes().hex(),
                "dequant_f32_bits": t["decoded"].astype("<f4").tobytes().hex(),
            }
            for t in tensors
        ],
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(oracle, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
