#!/usr/bin/env bash
# Creates (once) the venv the OpenAI-client test uses: PyPI's `openai` package, pinned.
# Usage: setup_venv.sh VENV_DIR   (prints the venv's python on success)
set -euo pipefail
venv="$1"
pin="openai==3.57.0"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "$pin"
fi
echo "$venv/bin/python"
