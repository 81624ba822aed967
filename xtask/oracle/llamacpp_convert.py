"""Runs llama.cpp's vendored convert_hf_to_gguf.py on a synthetic K3 checkpoint.

For `cargo xtask oracle-llamacpp`. The K3 converter's `set_vocab` reads the release's
tiktoken tokenizer through transformers; a synthetic checkpoint has no such tokenizer, so this
replaces it with a byte-level vocabulary of the config's `vocab_size` before handing over to
the converter's own `main()`. Nothing else of the converter is changed.

usage: llamacpp_convert.py --llama-cpp DIR -- CONVERTER_ARGS...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def byte_level_set_vocab(self) -> None:
    """A vocabulary of `vocab_size` tokens: the 256 bytes, then unused placeholders.

    The logits oracle feeds token ids straight to the model, so the vocabulary is only read
    when the file loads. "kimi-k2" is the pre-tokenizer the real K3 file names; llama.cpp
    accepts it without BPE merges, which a byte vocabulary does not have.
    """
    import gguf

    vocab_size = self.hparams["vocab_size"]
    if vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 byte tokens")
    byte_chars = gpt2_byte_chars()
    tokens = [byte_chars[b] for b in range(256)]
    tokens += [f"[PAD{i}]" for i in range(256, vocab_size)]
    toktypes = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.UNUSED] * (vocab_size - 256)
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("kimi-k2")
    self.gguf_writer.add_token_list(tokens)
    self.gguf_writer.add_token_types(toktypes)


def gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (the byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True,
                        help="the vendored llama.cpp directory (holds convert_hf_to_gguf.py)")
    parser.add_argument("converter_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    converter_args = args.converter_args
    if converter_args[:1] == ["--"]:
        converter_args = converter_args[1:]

    root = args.llama_cpp.resolve()
    # The converter's own gguf-py knows the kimi-k3 architecture; PyPI's gguf does not.
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    import convert_hf_to_gguf
    from conversion import kimi_k3

    kimi_k3.KimiK3Model.set_vocab = byte_level_set_vocab
    sys.argv = [str(root / "convert_hf_to_gguf.py"), *converter_args]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
