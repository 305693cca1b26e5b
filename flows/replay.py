"""Regression replay: a golden baseline of a few training steps, re-checked from the rollout cache.

``ppoflow replay record --dir DIR [--config NAME] [key=value ...]`` trains ``trainer.total_training_steps``
steps with the rollout cache in ``cache`` mode and writes, under ``DIR``::

    DIR/cache/          the step cache (skip.rollout.dump_dir): every step's rollout, as generated
    DIR/record/         the recording run's directory (metrics.jsonl, final policy)
    DIR/baseline.json   the golden baseline: per-step metrics, config fingerprint, code version

``ppoflow replay check --dir DIR [--tolerance METRIC=VALUE ...] [key=value ...]`` runs the
``regression-replay`` flow: the same training (the baseline's config and overrides, plus any extra
overrides) with every rollout replayed from ``DIR/cache`` - no generation - into ``DIR/replays/<time>``,
then compares every per-step metric with the baseline. Comparisons are exact unless a tolerance is
given (by metric name, or by a prefix ending in ``/``); timings, throughput, cache flags and staleness
(:data:`DEFAULT_IGNORED`) are never compared. On a CPU a replay reproduces the recording bit for bit, so
any difference means the trainer changed. A mismatch fails the flow run, makes the CLI exit 1, and is
listed in the table artifact ``regression-replay-<slug>`` (one version per check of the same DIR).

Validation is turned off in both runs (``trainer.test_freq=-1``): it generates, and a replay must not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ppoflow.configs import DEMO_NAME, ConfigError, config_as_dict, load_config
from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.tracking import json_number, read_metrics
from ppoflow.storage.fs import atomic_write, join, normalize_url, open_fs

FORMAT_VERSION = 1
BASELINE_FILE = "baseline.json"

DEFAULT_IGNORED = ("timing_s/", "perf/", "skip/", "training/off_policy/")
"""Metric name prefixes never compared: timings vary; cache hit flags differ by design between record and
replay; staleness is not reported for replayed batches."""

FORCED = ("trainer.test_freq=-1",)
"""Overrides of both the recording and the replay: validation generates, so it is off."""

ARTIFACT_ROWS = 500
"""At most this many mismatch rows go into the table artifact (the CLI prints fewer, see :func:`check`)."""

MISSING = "missing"
"""The ``baseline`` or ``value`` of a mismatch row for a metric (or step) one side does not have."""


class ReplayError(Exception):
    """A replay cannot be recorded or checked as asked (no baseline, an incomplete cache, bad arguments)."""


class ReplayMismatch(Exception):
    """The replayed metrics differ from the baseline; ``mismatches`` holds :func:`compare`'s rows."""

    def __init__(self, message: str, mismatches: list[dict]):
        super().__init__(message, mismatches)
        self.message, self.mismatches = message, mismatches

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------------------- baseline


def config_fingerprint(cfg: PPOConfig) -> str:
    """sha256 of the validated config as canonical JSON, without the keys that legitimately differ
    between a recording and its replays: ``trainer.default_local_dir`` and ``skip.*``."""
    data = config_as_dict(cfg)
    data.pop("skip", None)
    data.get("trainer", {}).pop("default_local_dir", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def code_version() -> dict[str, str | None]:
    """The installed ppoflow version and the git commit of this checkout (None where unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("ppoflow")
    except PackageNotFoundError:
        package = None
    checkout = Path(__file__).resolve().parent.parent
    try:
        toplevel, commit = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=checkout,
                                          capture_output=True, text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError, ValueError):
        commit = None
    else:  # not the commit of some repository the package happens to be installed inside
        commit = commit if Path(toplevel).resolve() == checkout else None
    return {"ppoflow": package, "git_commit": commit}


def cache_overrides(directory: str, steps: int) -> list[str]:
    """The rollout-cache overrides shared by the recording and its replays."""
    return ["skip.rollout.enable=true", "skip.rollout.action=cache", f"skip.rollout.dump_dir={join(directory, 'cache')}",
            f"skip.rollout.steps=[{','.join(str(step) for step in range(1, steps + 1))}]"]


def _config_name(config: str | None) -> str:
    """A preset name as given; a YAML path made absolute (a replay may run from another directory)."""
    if not config:
        return DEMO_NAME
    return str(Path(config).expanduser().resolve()) if config.endswith((".yaml", ".yml")) else config


def _total_steps(cfg: PPOConfig) -> int:
    steps = cfg.trainer.total_training_steps
    if not steps:
        raise ReplayError("a replay baseline needs a fixed number of steps: set trainer.total_training_steps=N")
    return steps


def record(directory: str, config: str | None = None, overrides: Sequence[str] = (), *, force: bool = False) -> dict:
    """Train the run's ``trainer.total_training_steps`` steps with the rollout cache in ``cache`` mode under
    ``directory`` and write ``directory/baseline.json``; returns the baseline.

    A ``directory`` that already holds a baseline or a cache is refused unless ``force`` (which deletes both
    first, so that every step is generated afresh by the code being recorded).
    """
    directory = normalize_url(directory)
    config, overrides = _config_name(config), list(overrides)
    cfg = load_config(config, overrides + list(FORCED))  # fail before Prefect and Ray start
    steps = _total_steps(cfg)
    fs, root = open_fs(directory)
    existing = [name for name in (BASELINE_FILE, "cache") if fs.exists(f"{root}/{name}")]
    if existing and not force:
        raise ReplayError(f"{directory} already holds {' and '.join(existing)}; re-record with --force "
                          "(deletes them) or choose another --dir")
    for name in existing:
        fs.rm(f"{root}/{name}", recursive=True)
    run_dir = join(directory, "record")
    from ppoflow.flows.train import ppo_train  # torch, Ray and the workers: imported when a run starts, not by the CLI

    words = overrides + list(FORCED) + cache_overrides(directory, steps) + [f"trainer.default_local_dir={run_dir}"]
    ppo_train(config=config, overrides=words)
    incomplete = missing_cache_steps(load_config(config, words), steps)
    if incomplete:  # a dump failed (see the run's warnings): a check of this baseline could only fail
        raise ReplayError(f"recorded {steps} steps but the cache under {join(directory, 'cache')} lacks "
                          + "; ".join(f"step {step} ({reason})" for step, reason in incomplete)
                          + "; no baseline written")
    baseline = {"format_version": FORMAT_VERSION, "config": config, "overrides": overrides,
                "config_fingerprint": config_fingerprint(cfg), "code_version": code_version(), "steps": steps,
                "metrics": read_metrics(run_dir)}
    fs.makedirs(root, exist_ok=True)
    atomic_write(fs, f"{root}/{BASELINE_FILE}", (json.dumps(baseline, indent=1) + "\n").encode())
    return baseline


def load_baseline(directory: str) -> dict:
    """The baseline recorded under ``directory``; :class:`ReplayError` when there is none."""
    directory = normalize_url(directory)
    fs, root = open_fs(directory)
    path = f"{root}/{BASELINE_FILE}"
    if not fs.exists(path):
        raise ReplayError(f"no replay baseline at {join(directory, BASELINE_FILE)}; "
                          f"record one first: ppoflow replay record --dir {directory} [key=value ...]")
    try:
        baseline = json.loads(fs.cat_file(path).decode())
    except ValueError as error:
        raise ReplayError(f"unreadable replay baseline {join(directory, BASELINE_FILE)}: {error}") from None
    if not isinstance(baseline, dict) or baseline.get("format_version") != FORMAT_VERSION:
        raise ReplayError(f"{join(directory, BASELINE_FILE)} is not a format-{FORMAT_VERSION} replay baseline")
    return baseline


# --------------------------------------------------------------------------------------- compare


def tolerance_for(metric: str, tolerances: Mapping[str, float]) -> float:
    """``metric``'s tolerance: its exact name, else the longest prefix key ending in ``/``, else 0 (exact)."""
    if metric in tolerances:
        return float(tolerances[metric])
    prefixes = [key for key in tolerances if key.endswith("/") and metric.startswith(key)]
    return float(tolerances[max(prefixes, key=len)]) if prefixes else 0.0


def compare(baseline_rows: Sequence[Mapping], rows: Sequence[Mapping], tolerances: Mapping[str, float] | None = None,
            *, ignored: Sequence[str] = DEFAULT_IGNORED) -> list[dict]:
    """Mismatches of ``rows`` against ``baseline_rows`` (both ``read_metrics`` rows, keyed by ``step``).

    For every step of the baseline and every metric of either side not under an ``ignored`` prefix, the
    absolute difference must be at most the metric's tolerance (see :func:`tolerance_for`). A metric or a
    step that one side lacks is a mismatch (its side reads ``"missing"``), and so is a non-finite value
    (``None``) facing a finite one. Returns ``{"step", "metric", "baseline", "value", "difference"}``
    rows, by step and metric; empty when everything matches.
    """
    tolerances = dict(tolerances or {})
    for key, tolerance in tolerances.items():
        if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
            raise ValueError(f"tolerance of {key!r} must be a number >= 0, got {tolerance!r}")
    replayed = {row["step"]: row for row in rows}
    mismatches = []
    for expected in sorted({row["step"]: row for row in baseline_rows}.values(), key=lambda row: row["step"]):
        step = expected["step"]
        actual = replayed.get(step, {})
        names = {name for name in (*expected, *actual) if name != "step" and not name.startswith(tuple(ignored))}
        for name in sorted(names):
            before, after = expected.get(name, MISSING), actual.get(name, MISSING)
            difference = _difference(before, after)
            if difference is None or difference > tolerance_for(name, tolerances):
                mismatches.append({"step": step, "metric": name, "baseline": before, "value": after,
                                   "difference": difference})
    return mismatches


def _difference(before: Any, after: Any) -> float | None:
    """``|after - before|`` for two numbers; 0 for equal values; None when they cannot match."""
    if before == after and MISSING not in (before, after):
        return 0.0
    if _number(before) and _number(after):
        difference = abs(float(after) - float(before))
        return difference if math.isfinite(difference) else None
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------- the flow


def artifact_key(directory: str) -> str:
    """``regression-replay-<slug>``: the baseline folder's name and a hash of its full location, so that
    every check of one baseline is a version of one artifact and two baselines never share one."""
    directory = normalize_url(directory)
    name = re.sub(r"[^a-z0-9]+", "-", directory.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha256(directory.encode()).hexdigest()[:8]
    return f"regression-replay-{name + '-' if name else ''}{digest}"


def replay_overrides(directory: str, baseline: dict, extra: Sequence[str], run_dir: str) -> list[str]:
    """What a replay trains with: the baseline's overrides, then ``extra``, then the cache settings."""
    return (list(baseline.get("overrides", [])) + list(extra) + list(FORCED)
            + cache_overrides(directory, int(baseline["steps"])) + [f"trainer.default_local_dir={run_dir}"])


def missing_cache_steps(cfg: PPOConfig, steps: int) -> list[tuple[int, str]]:
    """``(step, reason)`` for each of steps 1..``steps`` without a valid rollout entry in ``cfg``'s cache."""
    from ppoflow.storage.step_cache import StepCache
    from ppoflow.tasks.stages import run_cache_dir, storage_settings

    skip = cfg.skip["rollout"]
    cache = StepCache(run_cache_dir(skip, cfg), storage_options=storage_settings(skip))
    statuses = [cache.status(step) for step in range(1, steps + 1)]
    return [(status.step, f"{cache.step_url(status.step)}: {status.reason}") for status in statuses if not status.valid]


@flow(name="regression-replay", log_prints=True)
def regression_replay(directory: str, overrides: list[str] = [], tolerances: dict[str, float] = {}) -> dict:  # noqa: B006 (Prefect: a default list or dict keeps the parameter optional)
    """Re-run a recorded baseline's steps from its rollout cache (no generation) and compare every per-step
    metric with the baseline; on a mismatch the run fails, with a table artifact of the differences.

    Args:
        directory: Folder of the recorded baseline (baseline.json, cache/), a local path or fsspec URL.
        overrides: Extra key=value overrides on top of the baseline's, e.g.
            actor_rollout_ref.actor.clip_ratio_high=0.28 (the cache settings and run directory are set here).
        tolerances: Allowed absolute difference per metric name, or per prefix ending in '/'
            (e.g. {"actor/": 1e-6}); a metric without one must match exactly.
    """
    logger = get_run_logger()
    directory = normalize_url(directory)
    baseline = load_baseline(directory)
    steps = int(baseline["steps"])
    run_dir = join(directory, "replays", datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S-%fZ"))
    words = replay_overrides(directory, baseline, overrides, run_dir)
    cfg = load_config(baseline["config"], words)
    incomplete = missing_cache_steps(cfg, steps)
    if incomplete:
        raise ReplayError(f"the cache under {join(directory, 'cache')} is incomplete; a replay must not generate. "
                          + "; ".join(f"step {step}: {reason}" for step, reason in incomplete)
                          + f". Re-record: ppoflow replay record --dir {directory} --force")
    fingerprint = config_fingerprint(cfg)
    logger.info("replaying %d steps of %s into %s (config %s the baseline's)", steps, directory, run_dir,
                "same as" if fingerprint == baseline["config_fingerprint"] else "changed from")
    from ppoflow.flows.train import ppo_train

    train_state = ppo_train(config=baseline["config"], overrides=words, return_state=True)
    train_state.result()  # a failed training run fails the replay with its own error
    rows = read_metrics(run_dir)
    hits = {row["step"]: row.get("skip/rollout/hit") for row in rows}
    generated = [step for step in range(1, steps + 1) if hits.get(step) != 1]
    if generated:
        raise ReplayError(f"step {generated[0]} was generated, the cache is incomplete "
                          f"(steps not replayed from {join(directory, 'cache')}: {generated})")
    mismatches = compare(baseline["metrics"], rows, tolerances)
    compared = len({name for row in baseline["metrics"] for name in row
                    if name != "step" and not name.startswith(DEFAULT_IGNORED)})
    summary = {"directory": directory, "steps": steps, "metrics_compared": compared, "mismatches": len(mismatches),
               "replay_dir": run_dir, "train_flow_run_id": str(train_state.state_details.flow_run_id),
               "config_fingerprint": fingerprint,
               "config_changed": fingerprint != baseline["config_fingerprint"],
               "baseline_code_version": baseline.get("code_version"), "code_version": code_version()}
    _publish(directory, summary, mismatches, tolerances)
    if mismatches:
        steps_hit = sorted({row["step"] for row in mismatches})
        metrics_hit = sorted({row["metric"] for row in mismatches})
        raise ReplayMismatch(f"{len(mismatches)} metric values differ from the baseline in {directory} "
                             f"(steps {steps_hit}; metrics {', '.join(metrics_hit[:8])}"
                             f"{', ...' if len(metrics_hit) > 8 else ''})", mismatches)
    logger.info("all %d steps match the baseline (%d metrics each)", steps, compared)
    return summary


def _publish(directory: str, summary: dict, mismatches: list[dict], tolerances: Mapping[str, float]) -> None:
    """The table artifact of a check: one row per mismatch, or one row saying everything matched."""
    if mismatches:
        table = [{**row, "tolerance": json_number(tolerance_for(row["metric"], tolerances))}
                 for row in mismatches[:ARTIFACT_ROWS]]
        shown = f" (the first {ARTIFACT_ROWS})" if len(mismatches) > ARTIFACT_ROWS else ""
        verdict = f"**FAILED**: {len(mismatches)} metric values differ{shown}"
    else:
        table = [{"result": f"all {summary['steps']} steps match", "steps": summary["steps"],
                  "metrics_compared": summary["metrics_compared"]}]
        verdict = f"**passed**: all {summary['steps']} steps match"
    baseline_code, code = summary["baseline_code_version"] or {}, summary["code_version"]
    description = "\n".join([
        f"Regression replay of `{directory}`: {verdict}.",
        f"Config {'**changed** from' if summary['config_changed'] else 'same as'} the baseline's; "
        f"code {code.get('git_commit') or '?'} (ppoflow {code.get('ppoflow')}) against baseline "
        f"{baseline_code.get('git_commit') or '?'} (ppoflow {baseline_code.get('ppoflow')}).",
        f"Replay run directory: `{summary['replay_dir']}`."])
    create_table_artifact(table=table, key=artifact_key(directory), description=description)


# --------------------------------------------------------------------------------------- CLI


def check(directory: str, overrides: Sequence[str] = (), tolerances: Mapping[str, float] | None = None, *,
          out=None, max_rows: int = 50) -> bool:
    """Run the ``regression-replay`` flow and print its verdict (and up to ``max_rows`` mismatches);
    returns whether every step matched. A missing baseline or a bad override raises before the flow starts."""
    out = out or sys.stdout
    baseline = load_baseline(directory)
    load_config(baseline["config"], replay_overrides(normalize_url(directory), baseline, overrides,
                                                     join(normalize_url(directory), "replays", "check")))
    state = regression_replay(directory=directory, overrides=list(overrides), tolerances=dict(tolerances or {}),
                              return_state=True)
    if state.is_completed():
        summary = state.result()
        print(f"replay of {summary['directory']}: all {summary['steps']} steps match the baseline "
              f"({summary['metrics_compared']} metrics each)", file=out)
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
    lines = [header] + [(cell(row["step"]), row["metric"], cell(row["baseline"]), cell(row["value"]),
                         cell(row["difference"]), cell(tolerance_for(row["metric"], tolerances)))
                        for row in mismatches[:max_rows]]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(value.rjust(width) if i != 1 else value.ljust(width) for i, (value, width)
                      in enumerate(zip(line, widths))) for line in lines]
    if len(mismatches) > max_rows:
        text.append(f"... and {len(mismatches) - max_rows} more")
    return "\n".join(text)


def parse_tolerances(words: Sequence[str]) -> dict[str, float]:
    """``METRIC=VALUE`` words (a metric name or a prefix ending in ``/``) as a tolerance mapping."""
    tolerances = {}
    for word in words:
        metric, _, value = word.rpartition("=")
        try:
            tolerance = float(value)
        except ValueError:
            tolerance = -1.0
        if not metric or not (tolerance >= 0):
            raise ReplayError(f"--tolerance {word!r}: expected METRIC=VALUE with VALUE a number >= 0 "
                              "(METRIC a name, or a prefix ending in '/')")
        tolerances[metric] = tolerance
    return tolerances


def add_commands(subparsers) -> Any:
    """Add ``replay record`` and ``replay check`` to the CLI's subparsers; returns the command handler."""
    replay = subparsers.add_parser("replay", help="record a golden baseline of a few steps, or check the trainer "
                                                  "against one by replaying its rollouts")
    commands = replay.add_subparsers(dest="replay_command", required=True)
    recorder = commands.add_parser("record", help="train N steps (trainer.total_training_steps) into a rollout "
                                                  "cache and write DIR/baseline.json")
    recorder.add_argument("--dir", required=True, dest="directory", help="baseline folder (local path or fsspec URL)")
    recorder.add_argument("--config", default=None, help=f"preset name or YAML path (default: {DEMO_NAME})")
    recorder.add_argument("--force", action="store_true", help="replace an existing baseline and cache in DIR")
    recorder.add_argument("overrides", nargs="*", help="key=value overrides, lists as key=[1,2,3]")
    checker = commands.add_parser("check", help="replay DIR's steps from its cache and compare every metric "
                                                "with the baseline (exit 1 on a mismatch)")
    checker.add_argument("--dir", required=True, dest="directory", help="baseline folder written by replay record")
    checker.add_argument("--tolerance", action="append", default=[], metavar="METRIC=VALUE",
                         help="allowed absolute difference for a metric, or a prefix ending in '/' (default: exact)")
    checker.add_argument("overrides", nargs="*", help="extra key=value overrides on top of the baseline's")
    return run_command


def run_command(args: argparse.Namespace) -> int:
    """The ``replay`` command: 0 when recorded or matching, 1 on a mismatch, 2 on a usage or config error."""
    try:
        if args.replay_command == "record":
            baseline = record(args.directory, args.config, args.overrides, force=args.force)
            print(f"recorded {baseline['steps']} steps into {normalize_url(args.directory)} "
                  f"(baseline.json, config {baseline['config_fingerprint'][:12]}, "
                  f"commit {baseline['code_version']['git_commit'] or 'unknown'})")
            return 0
        return 0 if check(args.directory, args.overrides, parse_tolerances(args.tolerance)) else 1
    except (ReplayError, ConfigError) as error:
        print(f"ppoflow: {error}", file=sys.stderr)
        return 2
