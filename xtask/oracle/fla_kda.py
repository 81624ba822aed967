"""Freezes a KDA reference vector for the k3-model tests from flash-linear-attention (fla-core).

fla's pure-PyTorch references compute the two decay-gate forms (`naive_kda_lowerbound_gate`, the
K3 form, and `naive_kda_gate`, the Kimi-Linear softplus form) and the delta-rule recurrence
(`naive_recurrent_kda`). Our Rust `kda_log_decay`, `l2_norm` and `kda_step` must reproduce them.
Run it through `cargo xtask oracle-fla-kda`, which installs exact pins in a venv; nothing here is
meant to run in `cargo test`.

`naive_recurrent_kda` takes q and k as they are (it has no `use_qk_l2norm_in_kernel`); fla's
layers normalise them with `fla.modules.norm.l2norm`, a Triton-only kernel that computes
`x * (1 / sqrt(sum(x^2) + eps))` with eps = 1e-6. That formula is written out below in torch,
and the normalised q and k are recorded too.

The raw inputs come from a small splitmix64 generator rather than from numpy or torch, so that
the frozen bytes depend on the seed and the pinned fla, not on a library's random streams.
Every float is stored as the hex of its little-endian f32 bits, so nothing is lost to decimal.
"""

import argparse
import hashlib
import importlib.metadata
import json
import platform
import struct

import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda

from splitmix import SplitMix64

PACKAGES = ["fla-core", "einops", "torch"]
# B = 1. V differs from K so that a [K, V] / [V, K] mix-up cannot go unnoticed.
T, H, K, V = 12, 3, 16, 12
LOWER_BOUND = -5.0
L2NORM_EPS = 1e-6
# (t, h, d) channels whose pre-gate f is set so that z = f + dt_bias lies above torch's softplus
# threshold of 20, where softplus passes z through.
LARGE_Z = [(4, 1, 3, 23.5), (9, 2, 11, 20.75)]


def uniform(rng, shape, lo, hi):
    """f32 tensor of `shape`, uniform in [lo, hi) on a 2^-24 grid of the unit interval."""
    count = 1
    for n in shape:
        count *= n
    values = [lo + (hi - lo) * ((rng.next_u64() >> 40) / float(1 << 24)) for _ in range(count)]
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


def hex_f32(tensor):
    tensor = tensor.detach().to(torch.float32).contiguous().reshape(-1)
    return struct.pack(f"<{tensor.numel()}f", *tensor.tolist()).hex()


def l2norm(x):
    """fla's `l2norm_fwd` kernel (fla/modules/norm/l2norm.py) in torch:
    x * (1 / sqrt(sum x^2 + eps))."""
    rstd = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    return x * rstd


def source_sha256(module):
    with open(module.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    rng = SplitMix64(args.seed)
    q_raw = uniform(rng, (1, T, H, K), -1.0, 1.0)
    k_raw = uniform(rng, (1, T, H, K), -1.0, 1.0)
    v = uniform(rng, (1, T, H, V), -1.0, 1.0)
    f = uniform(rng, (1, T, H, K), -4.0, 4.0)
    dt_bias = uniform(rng, (H * K,), -1.0, 1.0)
    a_log = uniform(rng, (H,), -1.0, 1.0)
    beta_logit = uniform(rng, (1, T, H), -3.0, 3.0)
    for t, h, d, z in LARGE_Z:
        f[0, t, h, d] = z - dt_bias[h * K + d].item()

    q = l2norm(q_raw)
    k = l2norm(k_raw)
    beta = torch.sigmoid(beta_logit)
    scale = K**-0.5

    cases = []
    for name, g in [
        ("lower_bound", naive_kda_lowerbound_gate(f, a_log, dt_bias, lower_bound=LOWER_BOUND)),
        ("softplus", naive_kda_gate(f, a_log, dt_bias)),
    ]:
        assert g.dtype == torch.float32 and g.shape == (1, T, H, K)
        o, state = naive_recurrent_kda(
            q, k, v, g, beta, scale=scale, initial_state=None, output_final_state=True
        )
        assert o.dtype == torch.float32 and o.shape == (1, T, H, V)
        assert state.dtype == torch.float32 and state.shape == (1, H, K, V)
        case = {"gate": name, "g": hex_f32(g), "o": hex_f32(o), "final_state": hex_f32(state)}
        if name == "lower_bound":
            case["lower_bound"] = LOWER_BOUND
        cases.append(case)

    import fla.ops.kda.gate as gate_module
    import fla.ops.kda.naive as naive_module

    oracle = {
        "about": "fla-core's pure-PyTorch KDA references on small random inputs: decay gates "
        "(naive_kda_lowerbound_gate, naive_kda_gate) and naive_recurrent_kda in float32, "
        "scale K^-0.5, zero initial state, B = 1",
        "command": args.command,
        "packages": {name: importlib.metadata.version(name) for name in PACKAGES},
        "python": platform.python_version(),
        "fla_sources": {
            "fla/ops/kda/naive.py": source_sha256(naive_module),
            "fla/ops/kda/gate.py": source_sha256(gate_module),
        },
        "seed": args.seed,
        "shape": {"T": T, "H": H, "K": K, "V": V},
        "encoding": "hex of little-endian f32 bits, row-major in the layout given",
        "layouts": {
            "q_raw": "[T,H,K]",
            "k_raw": "[T,H,K]",
            "q_l2": "[T,H,K] (l2-normalised, before scale)",
            "k_l2": "[T,H,K]",
            "v": "[T,H,V]",
            "f": "[T,H,K] pre-gate, before dt_bias",
            "dt_bias": "[H*K], channel h*K+d",
            "a_log": "[H], one per head",
            "beta_logit": "[T,H]",
            "beta": "[T,H] = torch.sigmoid(beta_logit)",
            "g": "[T,H,K] log-decay",
            "o": "[T,H,V]",
            "final_state": "[H,K,V]",
        },
        "l2norm_eps": L2NORM_EPS,
        "scale": struct.pack("<f", scale).hex(),
        "large_z_channels": [[t, h, d, z] for t, h, d, z in LARGE_Z],
        "inputs": {
            "q_raw": hex_f32(q_raw),
            "k_raw": hex_f32(k_raw),
            "q_l2": hex_f32(q),
            "k_l2": hex_f32(k),
            "v": hex_f32(v),
            "f": hex_f32(f),
            "dt_bias": hex_f32(dt_bias),
            "a_log": hex_f32(a_log),
            "beta_logit": hex_f32(beta_logit),
            "beta": hex_f32(beta),
        },
        "cases": cases,
    }
    # Check the softplus pass-through channels really lie above the threshold in f32.
    z = f + dt_bias.view(H, K)
    for t, h, d, _ in LARGE_Z:
        assert z[0, t, h, d].item() > 20.0, (t, h, d, z[0, t, h, d].item())
    with open(args.out, "w") as out:
        json.dump(oracle, out, indent=1)
        out.write("\n")


if __name__ == "__main__":
    main()
