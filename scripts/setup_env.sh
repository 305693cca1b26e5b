#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install ppoflow into it with the given extras.
# torch goes first, pinned to a CPU build, so that nothing later pulls a multi-GB CUDA build.
# The first install skips pip's byte-compiling (one file at a time) and compiles site-packages with
# compileall on every core instead; the .pyc files must exist, since where PYTHONDONTWRITEBYTECODE is set
# every process would compile torch anew. Later installs let pip compile just what they add.
# Usage: source scripts/setup_env.sh [EXTRAS]      e.g. "dev" or "dev,vllm"
set -euo pipefail
VENV=${PPOFLOW_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
COMPILED="$VENV/.ppoflow-compiled"
NO_COMPILE=$([ -e "$COMPILED" ] || echo --no-compile)
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q $NO_COMPILE "torch==${PPOFLOW_TORCH:-2.13.0}"
python -m pip install -q $NO_COMPILE -e ".${1:+[$1]}"
if [ ! -e "$COMPILED" ]; then
    python -m compileall -qq -j 0 "$VENV"/lib/python3*/site-packages >/dev/null || true  # a few vendored files do not compile
    touch "$COMPILED"
fi
