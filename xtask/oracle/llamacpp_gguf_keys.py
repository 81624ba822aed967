"""Prints the GGUF metadata the vendored llama.cpp converter writes for a K3 config.json.

Runs `KimiK3Model.set_gguf_parameters` of `conversion/kimi_k3.py` (with `conversion/base.py`'s
`TextModel.set_gguf_parameters` under it) on the config's hyperparameters, with stand-in
`torch` and `transformers` modules: setting parameters touches neither, so only numpy and the
vendored gguf-py are needed. The list it prints is the expected metadata in
`xtask/src/gguf_k3_meta.rs`'s tests (the torch-free GGUF writer must write the same keys).

usage: llamacpp_gguf_keys.py --llama-cpp DIR CONFIG_JSON FILE_TYPE
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path


class _Stub(types.ModuleType):
    """A module whose every attribute is a fresh empty class (what the imports need)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {})
        setattr(self, name, cls)
        return cls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("config", type=Path)
    parser.add_argument("file_type", type=int, help="LlamaFileType (38: MOSTLY_MXFP4_MOE)")
    args = parser.parse_args()
    root = args.llama_cpp.resolve()
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    sys.modules["torch"] = _Stub("torch")
    sys.modules["transformers"] = _Stub("transformers")
    import gguf
    from conversion.kimi_k3 import KimiK3Model

    config = json.loads(args.config.read_text())
    model = object.__new__(KimiK3Model)
    model.hparams = {**config, **config.get("text_config", {})}
    model.block_count = model.hparams["num_hidden_layers"]
    model.rope_parameters = {}
    model.ftype = gguf.LlamaFileType(args.file_type)
    model.gguf_writer = gguf.GGUFWriter(path=None, arch="kimi-k3")
    model.set_gguf_parameters()
    for key, value in model.gguf_writer.kv_data[0].items():
        print(key, value.type.name, value.value)


if __name__ == "__main__":
    main()
