#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install ppoflow into it with the given extras.
# torch goes first, pinned to a CPU build, so that nothing later pulls a multi-GB CUDA build.
# The install is editable, so code changes need no reinstall: it is skipped when the venv's stamp for
# these extras records the same pyproject.toml, torch pin and python as its last install (a fresh clone,
# as in CI, has no venv and installs from scratch).
# The first install skips pip's byte-compiling (one file at a time) and compiles site-packages with
# compileall on every core instead; the .pyc files must exist, since where PYTHONDONTWRITEBYTECODE is set
# every process would compile torch anew. Later installs let pip compile just what they add.
# Usage: source scripts/setup_env.sh [EXTRAS]      e.g. "dev" or "dev,vllm"
set -euo pipefail
VENV=${PPOFLOW_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
STAMP="$VENV/.ppoflow-installed${1:+-$1}"  # one per set of extras: demo.sh and test.sh do not undo each other
TORCH="torch==${PPOFLOW_TORCH:-2.13.0}"
WANTED=$( { cat pyproject.toml; echo "extras=${1:-} $TORCH python=$(command -v python)"; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANTED" ]; then
    COMPILED="$VENV/.ppoflow-compiled"
    NO_COMPILE=$([ -e "$COMPILED" ] || echo --no-compile)
    python -m pip install -q --upgrade pip >/dev/null
    python -c "import torch" 2>/dev/null || python -m pip install -q $NO_COMPILE "$TORCH"
    # setuptools notes that an editable install of a package mapped onto the repository root (package-dir) uses
    # a meta path finder; nothing to act on, so not shown.
    PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q $NO_COMPILE -e ".${1:+[$1]}"
    if [ ! -e "$COMPILED" ]; then
        # the packages' own test folders are never imported; a few vendored files do not compile
        python -m compileall -qq -j 0 -x '/tests?/' "$VENV"/lib/python3*/site-packages >/dev/null || true
        touch "$COMPILED"
    fi
    echo "$WANTED" > "$STAMP"
fi
