"""The regression replay flow: record a golden baseline of a few training steps, then re-check it from the
rollout cache.

``ppoflow replay record --dir DIR`` trains with the rollout cache in ``cache`` mode and writes ``DIR/cache/``,
``DIR/record/`` and ``DIR/baseline.json``; ``ppoflow replay check --dir DIR [--tolerance METRIC=VALUE ...]`` runs
the ``regression-replay`` flow: the same training with every rollout replayed into ``DIR/replays/<time>``, then
every per-step metric compared with the baseline (exact unless a tolerance names it or its ``prefix/``; the
:data:`DEFAULT_IGNORED` metrics never). A mismatch fails the flow run, makes the CLI exit 1 and is listed in the
artifact ``regression-replay-<slug>``. Validation is off in both runs. Details: docs/deployments.md#regression-replay.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ppoflow.configs import load_config
from ppoflow.flows.replay.baseline import (
    BASELINE_FILE,
    FORCED,
    FORMAT_VERSION,
    ReplayError,
    cache_overrides,
    code_version,
    config_fingerprint,
    config_name,
    load_baseline,
    missing_cache_steps,
    total_steps,
    write_baseline,
)
from ppoflow.flows.replay.compare import DEFAULT_IGNORED, ReplayMismatch, compare, tolerance_for
from ppoflow.flows.tracking import json_number, read_metrics
from ppoflow.storage.fs import join, normalize_url, open_fs
from ppoflow.storage.step_cache import ROLLOUT_STAGE

ARTIFACT_ROWS = 500
"""At most this many mismatch rows go into the table artifact (the CLI prints fewer, see :func:`check`)."""


def record(directory: str, config: str | None = None, overrides: Sequence[str] = (), *, force: bool = False) -> dict:
    """Train the run's ``trainer.total_training_steps`` steps with the rollout cache in ``cache`` mode under
    ``directory`` and write ``directory/baseline.json``; returns the baseline.

    A ``directory`` that already holds a baseline or a cache is refused unless ``force`` (which deletes both
    first, so that every step is generated afresh by the code being recorded).
    """
    directory = normalize_url(directory)
    config, overrides = config_name(config), list(overrides)
    cfg = load_config(config, overrides + list(FORCED))  # fail before Prefect and Ray start
    steps = total_steps(cfg)
    fs, root = open_fs(directory)
    existing = [name for name in (BASELINE_FILE, "cache") if fs.exists(f"{root}/{name}")]
    if existing and not force:
        raise ReplayError(
            f"{directory} already holds {' and '.join(existing)}; re-record with --force "
            "(deletes them) or choose another --dir"
        )
    for name in existing:
        fs.rm(f"{root}/{name}", recursive=True)
    run_dir = join(directory, "record")
    from ppoflow.flows.train import run_ppo_train  # torch, Ray, workers: imported when a run starts, not by the CLI

    words = overrides + list(FORCED) + cache_overrides(directory, steps) + [f"trainer.default_local_dir={run_dir}"]
    recorded = load_config(config, words)
    run_ppo_train(config, words, recorded, "record")
    incomplete = missing_cache_steps(recorded, steps)
    if incomplete:  # a dump failed (see the run's warnings): a check of this baseline could only fail
        raise ReplayError(
            f"recorded {steps} steps but the cache under {join(directory, 'cache')} lacks "
            + "; ".join(f"step {step} ({reason})" for step, reason in incomplete)
            + "; no baseline written"
        )
    baseline = {
        "format_version": FORMAT_VERSION,
        "config": config,
        "overrides": overrides,
        "config_fingerprint": config_fingerprint(cfg),
        "code_version": code_version(),
        "steps": steps,
        "metrics": read_metrics(run_dir),
    }
    write_baseline(directory, baseline)
    return baseline


def artifact_key(directory: str) -> str:
    """``regression-replay-<slug>``: the baseline folder's name and a hash of its full location, so that
    every check of one baseline is a version of one artifact and two baselines never share one."""
    directory = normalize_url(directory)
    name = re.sub(r"[^a-z0-9]+", "-", directory.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha256(directory.encode()).hexdigest()[:8]
    return f"regression-replay-{name + '-' if name else ''}{digest}"


def replay_overrides(directory: str, baseline: dict, extra: Sequence[str], run_dir: str) -> list[str]:
    """What a replay trains with: the baseline's overrides, then ``extra``, then the cache settings."""
    return (
        list(baseline.get("overrides", []))
        + list(extra)
        + list(FORCED)
        + cache_overrides(directory, int(baseline["steps"]))
        + [f"trainer.default_local_dir={run_dir}"]
    )


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
    run_dir = join(directory, "replays", datetime.now(UTC).strftime("%Y%m%dT%H%M%S-%fZ"))
    words = replay_overrides(directory, baseline, overrides, run_dir)
    cfg = load_config(baseline["config"], words)
    incomplete = missing_cache_steps(cfg, steps)
    if incomplete:
        raise ReplayError(
            f"the cache under {join(directory, 'cache')} is incomplete; a replay must not generate. "
            + "; ".join(f"step {step}: {reason}" for step, reason in incomplete)
            + f". Re-record: ppoflow replay record --dir {directory} --force"
        )
    fingerprint = config_fingerprint(cfg)
    logger.info(
        "replaying %d steps of %s into %s (config %s the baseline's)",
        steps,
        directory,
        run_dir,
        "same as" if fingerprint == baseline["config_fingerprint"] else "changed from",
    )
    from ppoflow.flows.train import run_ppo_train

    train_state = run_ppo_train(baseline["config"], words, cfg, "replay", return_state=True)
    train_state.result()  # a failed training run fails the replay with its own error
    rows = read_metrics(run_dir)
    hits = {row["step"]: row.get(f"skip/{ROLLOUT_STAGE}/hit") for row in rows}
    generated = [step for step in range(1, steps + 1) if hits.get(step) != 1]
    if generated:
        raise ReplayError(
            f"step {generated[0]} was generated, the cache is incomplete "
            f"(steps not replayed from {join(directory, 'cache')}: {generated})"
        )
    mismatches = compare(baseline["metrics"], rows, tolerances)
    compared = len(
        {name for row in baseline["metrics"] for name in row if name != "step" and not name.startswith(DEFAULT_IGNORED)}
    )
    summary = {
        "directory": directory,
        "steps": steps,
        "metrics_compared": compared,
        "mismatches": len(mismatches),
        "replay_dir": run_dir,
        "train_flow_run_id": str(train_state.state_details.flow_run_id),
        "config_fingerprint": fingerprint,
        "config_changed": fingerprint != baseline["config_fingerprint"],
        "baseline_code_version": baseline.get("code_version"),
        "code_version": code_version(),
    }
    _publish(directory, summary, mismatches, tolerances)
    if mismatches:
        steps_hit = sorted({row["step"] for row in mismatches})
        metrics_hit = sorted({row["metric"] for row in mismatches})
        raise ReplayMismatch(
            f"{len(mismatches)} metric values differ from the baseline in {directory} "
            f"(steps {steps_hit}; metrics {', '.join(metrics_hit[:8])}"
            f"{', ...' if len(metrics_hit) > 8 else ''})",
            mismatches,
        )
    logger.info("all %d steps match the baseline (%d metrics each)", steps, compared)
    return summary


def _publish(directory: str, summary: dict, mismatches: list[dict], tolerances: Mapping[str, float]) -> None:
    """The table artifact of a check: one row per mismatch, or one row saying everything matched."""
    if mismatches:
        table = [
            {**row, "tolerance": json_number(tolerance_for(row["metric"], tolerances))}
            for row in mismatches[:ARTIFACT_ROWS]
        ]
        shown = f" (the first {ARTIFACT_ROWS})" if len(mismatches) > ARTIFACT_ROWS else ""
        verdict = f"**FAILED**: {len(mismatches)} metric values differ{shown}"
    else:
        table = [
            {
                "result": f"all {summary['steps']} steps match",
                "steps": summary["steps"],
                "metrics_compared": summary["metrics_compared"],
            }
        ]
        verdict = f"**passed**: all {summary['steps']} steps match"
    baseline_code, code = summary["baseline_code_version"] or {}, summary["code_version"]
    description = "\n".join(
        [
            f"Regression replay of `{directory}`: {verdict}.",
            f"Config {'**changed** from' if summary['config_changed'] else 'same as'} the baseline's; "
            f"code {code.get('git_commit') or '?'} (ppoflow {code.get('ppoflow')}) against baseline "
            f"{baseline_code.get('git_commit') or '?'} (ppoflow {baseline_code.get('ppoflow')}).",
            f"Replay run directory: `{summary['replay_dir']}`.",
        ]
    )
    create_table_artifact(table=table, key=artifact_key(directory), description=description)
