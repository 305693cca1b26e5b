"""The code is lint clean and formatted, as ``pyproject.toml``'s ``[tool.ruff]`` says: a lint problem fails the
test command (and CI) like any other test. Fix with ``ruff check --fix . && ruff format .``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    done = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


MAX_MODULE_DOCSTRING_LINES = 12


def test_module_docstrings_are_short():
    """A module docstring says what the module is and why it exists; the essays live in docs/."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in (".venv", "tests") or any(part.startswith(".") for part in relative.parts):
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if docstring is not None and len(docstring.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            offenders.append(f"{relative}: {len(docstring.splitlines())} lines")
    assert not offenders, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the details to docs/ and point there):\n"
        + "\n".join(offenders)
    )
