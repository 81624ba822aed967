"""Freezes a tokenizer reference vector for the k3-model tests from the PyPI `tiktoken` package.

The vocabulary is the synthetic checkpoints' (`tiktoken.model` and `tokenizer_config.json`,
written by `cargo xtask oracle-tiktoken` next to the vector); the split pattern is the Kimi
pre-tokenizer regex of docs/MODEL.md §10.1, written out here from the spec on its own. tiktoken
encodes a few hundred strings made from fragments that exercise every alternative of the
pattern (contractions, digit runs, punctuation, newlines and whitespace runs, Han and other
scripts, emoji, special-token strings), each once with special tokens allowed and once with
them treated as ordinary text. Run it through `cargo xtask oracle-tiktoken`; nothing here runs
in `cargo test`.
"""

import argparse
import base64
import hashlib
import importlib.metadata
import json
import platform

import tiktoken

from splitmix import SplitMix64

PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

FRAGMENTS = [
    "The engine reads", " every weight", " once per token.", "Hello", " world", "don't",
    " I'M", " we'll", " THEY'RE", " you've", "'s", "'D", " It's", " 42", "12345", "1234567",
    " 3.14159", "2026-11-29", "\n", "\r\n", "\n\n\n", "  ", "\t", "   leading", "trailing   ",
    "!!!", " ...", "?!", " (parens)", "[brackets]", "{braces}", "«quotes»", "\"dq\"", "naïve",
    " café", "Ελληνικά", " Русский текст", " 中文字符", "記憶體的頻寬決定速度。", "日本語のテキスト",
    " 한국어", " العربية", " emoji 😀🚀", "\u00a0nbsp", "x=y+z;", "fn main() {}", " a_b-c",
    "MiXeD CaSe", "ÀÉÎÕÜ", "ﬁ ligature", "\u200bzero", " १२३ देवनागरी", "ǅ titlecase",
    " <|open|>", "<|end_of_msg|>", "[BOS]", "<|sep|>", "[EOS] ", "<|close|>message",
    " tab\tsep", "    \n    ", "x\r\ny", " ", "", "memory.", " Experts", " MXFP4", "E8M0",
    " 0xFF", "Le moteur lit", " Der Speicher", "\u3000ideographic space", "’curly’",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--vocab", required=True, help="directory with tiktoken.model and tokenizer_config.json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model_path = f"{args.vocab}/tiktoken.model"
    with open(model_path, "rb") as f:
        model_bytes = f.read()
    ranks = {}
    for line in model_bytes.decode().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    with open(f"{args.vocab}/tokenizer_config.json") as f:
        config = json.load(f)
    specials = {t["content"]: int(i) for i, t in config["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding(
        name="k3-synthetic", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )

    rng = SplitMix64(args.seed)
    texts = list(FRAGMENTS)
    for _ in range(240):
        n = 1 + rng.below(8)
        texts.append("".join(FRAGMENTS[rng.below(len(FRAGMENTS))] for _ in range(n)))
    # Long runs: past the 25,000-character whitespace cut, and a long word.
    texts.append("a" + " " * 25010 + "b")
    texts.append("word" * 3000)
    cases = []
    for text in texts:
        for allow in (False, True):
            if allow:
                ids = enc.encode(text, allowed_special="all")
            else:
                ids = enc.encode(text, allowed_special=set(), disallowed_special=())
            cases.append({"text": text, "allow_special": allow, "ids": ids})

    packages = {name: importlib.metadata.version(name) for name in ["tiktoken", "regex"]}
    packages["python"] = platform.python_version()
    vector = {
        "command": args.command,
        "packages": packages,
        "pattern": PATTERN,
        "vocab_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "seed": args.seed,
        "cases": cases,
    }
    with open(args.out, "w") as f:
        json.dump(vector, f, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    main()
