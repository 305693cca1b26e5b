"""Shared by the tests of the command line (tests/test_preflight*.py and others): ``ppoflow`` run in this process,
the check that it ended as a user error (exit 2, one message, no traceback), and the demo's ``ppoflow train`` as a
subprocess command."""

from __future__ import annotations

import sys

from ppoflow.flows.cli import main

DEMO = ("train", "--config", "grpo_tiny")
"""``ppoflow train`` on the demo preset: tests pass their own tiny model, which without ``--config`` would select
verl's defaults."""
DEMO_TRAIN = [sys.executable, "-m", "ppoflow.flows.cli", *DEMO]
"""The same in a process of its own."""


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``ppoflow argv...`` in this process: its exit code and what it wrote to stderr."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def assert_user_error(code: int, stderr: str, *named: str) -> None:
    assert code == 2, stderr
    assert "\nppoflow: " in f"\n{stderr}", stderr  # after any warning logged while waiting for storage
    for text in named:
        assert text in stderr, (text, stderr)
    assert "Traceback" not in stderr


def run_dir(tmp_path) -> str:
    return f"trainer.default_local_dir={tmp_path}/run"
