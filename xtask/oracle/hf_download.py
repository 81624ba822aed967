"""The oracle of `cargo xtask oracle-hf-download`: parses an `hf download` command with
huggingface_hub's own CLI (its download functions replaced by a recorder, so nothing is
fetched) and applies huggingface_hub's own pattern filter to the repository's file listing,
so the docs' download command is checked by the tool users run, not by our reading of it."""
import argparse, json, shlex, sys, warnings
from unittest import mock

import huggingface_hub
from huggingface_hub.cli import download as dl
from huggingface_hub.cli.hf import app
from huggingface_hub.utils import filter_repo_objects
from click.testing import CliRunner

p = argparse.ArgumentParser()
p.add_argument("--command", required=True)
p.add_argument("--files", required=True, help="JSON list of the repository's files")
p.add_argument("--out", required=True)
a = p.parse_args()
argv = shlex.split(a.command)
assert argv[:2] == ["hf", "download"], argv
files = json.load(open(a.files))
calls = []
def snapshot(**kw):
    calls.append(("snapshot_download", kw)); return "/nowhere"
def one(**kw):
    calls.append(("hf_hub_download", kw)); return "/nowhere"
with warnings.catch_warnings(record=True) as caught, \
        mock.patch.object(dl, "snapshot_download", snapshot), \
        mock.patch.object(dl, "hf_hub_download", one):
    warnings.simplefilter("always")
    result = CliRunner().invoke(app, argv[1:])
assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
assert len(calls) == 1, calls
kind, kw = calls[0]
if kind == "hf_hub_download":
    selected = [kw["filename"]] if kw["filename"] in files else []
    allow, ignore = [kw["filename"]], None
else:
    allow, ignore = kw["allow_patterns"], kw["ignore_patterns"]
    selected = list(filter_repo_objects(files, allow_patterns=allow, ignore_patterns=ignore))
json.dump({
    "command": a.command,
    "huggingface_hub": huggingface_hub.__version__,
    "call": kind,
    "allow_patterns": allow,
    "ignore_patterns": ignore,
    "warnings": [str(w.message) for w in caught],
    "files": files,
    "selected": selected,
}, open(a.out, "w"), indent=1)
print(json.dumps({"selected": len(selected), "warnings": [str(w.message) for w in caught]}))
