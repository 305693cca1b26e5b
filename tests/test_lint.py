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


def python_files(*skip: str) -> list[Path]:
    """The repository's .py files, outside .venv, hidden folders and the top-level folders in ``skip``."""
    return [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if (relative := path.relative_to(ROOT)).parts[0] not in (".venv", *skip)
        and not any(part.startswith(".") for part in relative.parts)
    ]


MAX_MODULE_DOCSTRING_LINES = 12


def test_module_docstrings_are_short():
    """A module docstring says what the module is and why it exists; the essays live in docs/."""
    offenders = []
    for path in python_files("tests"):
        relative = path.relative_to(ROOT)
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if docstring is not None and len(docstring.splitlines()) > MAX_MODULE_DOCSTRING_LINES:
            offenders.append(f"{relative}: {len(docstring.splitlines())} lines")
    assert not offenders, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the details to docs/ and point there):\n"
        + "\n".join(offenders)
    )


MAX_FILE_LINES = 400


def test_no_python_file_is_over_400_lines():
    """No source file, tests included, is over 400 lines: a longer one is split by topic (shared test helpers go
    to a tests/<topic>_helpers.py or tests/conftest.py)."""
    lengths = {path.relative_to(ROOT): len(path.read_text(encoding="utf-8").splitlines()) for path in python_files()}
    assert Path("tests/test_lint.py") in lengths and Path("flows/cli.py") in lengths  # tests included
    offenders = [f"{name}: {count} lines" for name, count in lengths.items() if count > MAX_FILE_LINES]
    assert not offenders, f"files over {MAX_FILE_LINES} lines (split them by topic):\n" + "\n".join(offenders)
