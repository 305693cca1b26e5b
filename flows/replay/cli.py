"""``ppoflow replay record`` and ``ppoflow replay check``: the regression replay from the command line.

The flow, the config and the baseline are imported where a command runs them, so that adding the
commands to the parser (``ppoflow --help``) imports neither Prefect nor the config schema.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ppoflow.flows.replay.compare import ReplayMismatch, tolerance_for


def check(
    directory: str,
    overrides: Sequence[str] = (),
    tolerances: Mapping[str, float] | None = None,
    *,
    out=None,
    max_rows: int = 50,
) -> bool:
    """Run the ``regression-replay`` flow and print its verdict (and up to ``max_rows`` mismatches);
    returns whether every step matched. A missing baseline or a bad override raises before the flow starts."""
    from ppoflow.configs import load_config
    from ppoflow.flows.replay.baseline import load_baseline
    from ppoflow.flows.replay.flow import artifact_key, regression_replay, replay_overrides
    from ppoflow.storage.fs import join, normalize_url

    out = out or sys.stdout
    baseline = load_baseline(directory)
    load_config(
        baseline["config"],
        replay_overrides(
            normalize_url(directory), baseline, overrides, join(normalize_url(directory), "replays", "check")
        ),
    )
    from prefect import tags

    with tags("replay"):  # the check's flow run, and the training run inside it
        state = regression_replay(
            directory=directory, overrides=list(overrides), tolerances=dict(tolerances or {}), return_state=True
        )
    if state.is_completed():
        summary = state.result()
        print(
            f"replay of {summary['directory']}: all {summary['steps']} steps match the baseline "
            f"({summary['metrics_compared']} metrics each)",
            file=out,
        )
        return True
    try:
        error = state.result(raise_on_failure=False)
    except Exception as unreadable:  # a crashed run may have no result to read
        error = unreadable
    if isinstance(error, ReplayMismatch):
        print(f"replay FAILED: {error}", file=out)
        print(format_table(error.mismatches, tolerances or {}, max_rows=max_rows), file=out)
        print(f"(table artifact {artifact_key(directory)})", file=out)
    else:
        print(f"replay FAILED: {error if isinstance(error, BaseException) else state.message}", file=out)
    return False


def format_table(mismatches: list[dict], tolerances: Mapping[str, float], *, max_rows: int = 50) -> str:
    """Mismatch rows as aligned text, floats in full precision."""

    def cell(value) -> str:
        return "-" if value is None else repr(value) if isinstance(value, float) else str(value)

    header = ("step", "metric", "baseline", "value", "difference", "tolerance")
    lines = [header] + [
        (
            cell(row["step"]),
            row["metric"],
            cell(row["baseline"]),
            cell(row["value"]),
            cell(row["difference"]),
            cell(tolerance_for(row["metric"], tolerances)),
        )
        for row in mismatches[:max_rows]
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "  ".join(
            value.rjust(width) if i != 1 else value.ljust(width) for i, (value, width) in enumerate(zip(line, widths))
        )
        for line in lines
    ]
    if len(mismatches) > max_rows:
        text.append(f"... and {len(mismatches) - max_rows} more")
    return "\n".join(text)


def parse_tolerances(words: Sequence[str]) -> dict[str, float]:
    """``METRIC=VALUE`` words (a metric name or a prefix ending in ``/``) as a tolerance mapping."""
    from ppoflow.flows.replay.baseline import ReplayError

    tolerances = {}
    for word in words:
        metric, _, value = word.rpartition("=")
        try:
            tolerance = float(value)
        except ValueError:
            tolerance = -1.0
        if not metric or not (tolerance >= 0):
            raise ReplayError(
                f"--tolerance {word!r}: expected METRIC=VALUE with VALUE a number >= 0 "
                "(METRIC a name, or a prefix ending in '/')"
            )
        tolerances[metric] = tolerance
    return tolerances


def add_commands(subparsers) -> Any:
    """Add ``replay record`` and ``replay check`` to the CLI's subparsers; returns the command handler."""
    replay = subparsers.add_parser(
        "replay",
        help="record a golden baseline of a few steps, or check the trainer against one by replaying its rollouts",
    )
    commands = replay.add_subparsers(dest="replay_command", required=True)
    recorder = commands.add_parser(
        "record", help="train N steps (trainer.total_training_steps) into a rollout cache and write DIR/baseline.json"
    )
    recorder.add_argument("--dir", required=True, dest="directory", help="baseline folder (local path or fsspec URL)")
    recorder.add_argument("--config", default=None, help="preset name or YAML path (default: grpo_tiny)")
    recorder.add_argument("--force", action="store_true", help="replace an existing baseline and cache in DIR")
    recorder.add_argument("overrides", nargs="*", help="key=value overrides, lists as key=[1,2,3]")
    checker = commands.add_parser(
        "check",
        help="replay DIR's steps from its cache and compare every metric with the baseline (exit 1 on a mismatch)",
    )
    checker.add_argument("--dir", required=True, dest="directory", help="baseline folder written by replay record")
    checker.add_argument(
        "--tolerance",
        action="append",
        default=[],
        metavar="METRIC=VALUE",
        help="allowed absolute difference for a metric, or a prefix ending in '/' (default: exact)",
    )
    checker.add_argument("overrides", nargs="*", help="extra key=value overrides on top of the baseline's")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    """The ``replay`` command: 0 when recorded or matching, 1 on a mismatch, 2 on a usage or config error."""
    from ppoflow.configs import ConfigError
    from ppoflow.flows.replay.baseline import ReplayError
    from ppoflow.flows.replay.flow import record
    from ppoflow.storage.fs import normalize_url

    try:
        if args.replay_command == "record":
            baseline = record(args.directory, args.config, args.overrides, force=args.force)
            print(
                f"recorded {baseline['steps']} steps into {normalize_url(args.directory)} "
                f"(baseline.json, config {baseline['config_fingerprint'][:12]}, "
                f"commit {baseline['code_version']['git_commit'] or 'unknown'})"
            )
            return 0
        return 0 if check(args.directory, args.overrides, parse_tolerances(args.tolerance)) else 1
    except (ReplayError, ConfigError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
