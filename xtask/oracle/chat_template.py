"""Renders K3 chat conversations with llama.cpp's Kimi-K3 chat template, for the k3-model tests.

The template is `vendor/llama.cpp/models/templates/Kimi-K3.jinja` from the llama-cpp-python
sdist (it says it matches the release's encoder); the renderer is PyPI `jinja2` set up the way
Hugging Face `transformers` sets up chat templates (`apply_chat_template`): a sandboxed
environment with `trim_blocks`, `lstrip_blocks` and the loop-controls extension, `tojson` as
`json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` (jinja2's own
`tojson` has no `ensure_ascii` argument, which the template passes) and `raise_exception`.
Each conversation is rendered with `add_generation_prompt=True` and only the variables it
defines (`tools`, `thinking`, `thinking_effort`, `tool_choice`, `response_format`), since the
template tests whether they are defined. Run it through `cargo xtask oracle-chat`; nothing here
runs in `cargo test`.
"""

import argparse
import hashlib
import importlib.metadata
import json
import platform

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

VARIABLES = ["tools", "thinking", "thinking_effort", "tool_choice", "response_format"]


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--template", required=True)
    parser.add_argument("--conversations", required=True)
    parser.add_argument("--sdist", required=True, help="the sdist's file name")
    parser.add_argument("--sdist-sha256", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    with open(args.template, encoding="utf-8") as f:
        template = env.from_string(f.read())
    with open(args.conversations, encoding="utf-8") as f:
        conversations = json.load(f)["conversations"]

    cases = []
    names = set()
    for conversation in conversations:
        name = conversation["name"]
        if name in names:
            raise SystemExit(f"conversation name {name!r} is used twice")
        names.add(name)
        variables = {k: conversation[k] for k in VARIABLES if k in conversation}
        rendered = template.render(messages=conversation["messages"], add_generation_prompt=True,
                                   **variables)
        cases.append({"name": name, "rendered": rendered})

    out = {
        "what": "llama.cpp's Kimi-K3 chat template rendered with jinja2 for each conversation of "
                "conversations.json (add_generation_prompt=True)",
        "command": args.command,
        "sdist": args.sdist,
        "sdist_sha256": args.sdist_sha256,
        "template": "vendor/llama.cpp/models/templates/Kimi-K3.jinja",
        "template_sha256": sha256(args.template),
        "conversations_sha256": sha256(args.conversations),
        "environment": "jinja2 ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, "
                       "extensions=[loopcontrols]); tojson = json.dumps(ensure_ascii=False) as in "
                       "transformers' apply_chat_template",
        "packages": {"jinja2": importlib.metadata.version("jinja2")},
        "python": platform.python_version(),
        "cases": cases,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
