"""Shared by the tests of bad input on the command line (tests/test_preflight*.py and others): ``ppoflow``
run in this process, and the check that it ended as a user error (exit 2, one message, no traceback)."""

from __future__ import annotations

from ppoflow.flows.cli import main


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
