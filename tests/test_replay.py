"""Regression replay: ``compare`` on its own, then record / check end to end on the session's Prefect
server and local Ray - an unchanged trainer passes with every step replayed from the cache, a changed PPO
loss (tighter clip ratios) fails the flow run, the CLI, and lists its differences in a table artifact."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time

import pytest

from ppoflow.flows.replay import add_commands, regression_replay
from ppoflow.flows.replay.baseline import ReplayError
from ppoflow.flows.replay.cli import check, parse_tolerances
from ppoflow.flows.replay.compare import DEFAULT_IGNORED, MISSING, compare, tolerance_for
from ppoflow.flows.replay.flow import artifact_key, record
from ppoflow.flows.tracking import read_metrics
from tests.conftest import REPLAY_EPOCHS as EPOCHS
from tests.conftest import REPLAY_STEPS as STEPS

TIGHT_CLIP = ["actor_rollout_ref.actor.clip_ratio_high=0.01", "actor_rollout_ref.actor.clip_ratio_low=0.01"]


# --------------------------------------------------------------------------------------- compare


def rows(*steps: dict) -> list[dict]:
    return [{"step": step, **metrics} for step, metrics in enumerate(steps, start=1)]


def test_compare_is_exact_by_default():
    baseline = rows({"actor/pg_loss": 0.5, "critic/score/mean": 1.0}, {"actor/pg_loss": 0.25, "critic/score/mean": 2})
    assert compare(baseline, [dict(row) for row in baseline], {}) == []
    changed = rows(
        {"actor/pg_loss": 0.5, "critic/score/mean": 1.0}, {"actor/pg_loss": 0.25 + 1e-12, "critic/score/mean": 2.0}
    )
    assert compare(baseline, changed, {}) == [
        {
            "step": 2,
            "metric": "actor/pg_loss",
            "baseline": 0.25,
            "value": 0.25 + 1e-12,
            "difference": pytest.approx(1e-12),
        }
    ]


def test_compare_tolerance_by_name_and_by_prefix():
    baseline = rows({"actor/pg_loss": 1.0, "actor/grad_norm": 1.0, "critic/score/mean": 1.0})
    replay = rows({"actor/pg_loss": 1.05, "actor/grad_norm": 1.2, "critic/score/mean": 1.001})
    assert [row["metric"] for row in compare(baseline, replay, {})] == [
        "actor/grad_norm",
        "actor/pg_loss",
        "critic/score/mean",
    ]
    assert compare(baseline, replay, {"actor/": 0.3, "critic/score/mean": 0.01}) == []
    # the exact name wins over a prefix, and the longest prefix over a shorter one
    tolerances = {"actor/": 0.3, "actor/pg_loss": 0.01, "critic/": 0.0, "critic/score/": 0.01}
    assert tolerance_for("actor/pg_loss", tolerances) == 0.01 and tolerance_for("critic/score/mean", tolerances) == 0.01
    assert tolerance_for("response_length/mean", tolerances) == 0.0
    assert [(row["metric"], row["difference"]) for row in compare(baseline, replay, tolerances)] == [
        ("actor/pg_loss", pytest.approx(0.05))
    ]
    assert compare(baseline, replay, {"actor": 1.0, "critic/score/mean": 0.01})  # a prefix must end in "/"
    with pytest.raises(ValueError, match="must be a number >= 0"):
        compare(baseline, replay, {"actor/": -1})


def test_compare_never_looks_at_ignored_prefixes():
    baseline = rows(
        {
            "actor/pg_loss": 1.0,
            "timing_s/step": 0.3,
            "perf/generate_overlap_ratio": 0.5,
            "skip/rollout/hit": 0,
            "training/off_policy/trajectory_staleness/mean": 0.0,
        }
    )
    replay = rows({"actor/pg_loss": 1.0, "timing_s/step": 0.1, "skip/rollout/hit": 1, "skip/rollout/load_step": 1})
    assert set(DEFAULT_IGNORED) == {"timing_s/", "perf/", "skip/", "training/off_policy/"}
    assert compare(baseline, replay, {}) == []


def test_compare_reports_missing_metrics_and_steps():
    baseline = rows({"actor/pg_loss": 1.0, "actor/entropy": 2.0, "timing_s/step": 1.0}, {"actor/pg_loss": 0.5})
    replay = [{"step": 1, "actor/pg_loss": 1.0, "actor/new_metric": 3.0}]
    assert compare(baseline, replay, {"actor/": 10.0}) == [
        {"step": 1, "metric": "actor/entropy", "baseline": 2.0, "value": MISSING, "difference": None},
        {"step": 1, "metric": "actor/new_metric", "baseline": MISSING, "value": 3.0, "difference": None},
        {"step": 2, "metric": "actor/pg_loss", "baseline": 0.5, "value": MISSING, "difference": None},
    ]
    # a non-finite value (None in metrics.jsonl) matches only a non-finite value
    assert compare(rows({"actor/kl": None}), rows({"actor/kl": None}), {}) == []
    assert compare(rows({"actor/kl": None}), rows({"actor/kl": 0.0}), {"actor/": 1.0})[0]["difference"] is None


def test_tolerance_words_and_artifact_key(tmp_path):
    assert parse_tolerances(["actor/pg_loss=1e-6", "critic/=0.5"]) == {"actor/pg_loss": 1e-6, "critic/": 0.5}
    for bad in ("actor/pg_loss", "=1", "actor/pg_loss=abc", "actor/pg_loss=-1"):
        with pytest.raises(ReplayError, match="METRIC=VALUE"):
            parse_tolerances([bad])
    key = artifact_key(str(tmp_path / "My Baseline_v1"))
    assert key.startswith("regression-replay-my-baseline-v1-") and all(
        c.islower() or c.isdigit() or c == "-" for c in key
    )
    assert artifact_key(str(tmp_path / "a" / "x")) != artifact_key(str(tmp_path / "b" / "x"))


def test_the_flow_parameters_make_a_form_with_only_the_directory_required():
    schema = regression_replay.parameters.model_dump()
    assert schema["required"] == ["directory"]
    properties = schema["properties"]
    assert properties["overrides"]["default"] == [] and properties["tolerances"]["default"] == {}
    assert properties["tolerances"]["additionalProperties"] == {"type": "number"}
    assert all(properties[name].get("description") for name in ("directory", "overrides", "tolerances"))


# --------------------------------------------------------------------------------------- errors before any run


@pytest.fixture
def prefect(prefect_api):
    return prefect_api


def cli(argv: list[str]) -> int:
    """``ppoflow replay ...`` through the same argparse set-up as ``flows.cli``."""
    parser = argparse.ArgumentParser(prog="ppoflow")
    handler = add_commands(parser.add_subparsers(dest="command", required=True))
    return handler(parser.parse_args(argv))


def test_missing_baseline_is_a_clear_error(prefect, tmp_path, capsys):
    missing = tmp_path / "nothing-recorded"
    with pytest.raises(ReplayError, match=f"no replay baseline at {missing}/baseline.json; record one first"):
        check(str(missing))
    assert cli(["replay", "check", "--dir", str(missing)]) == 2
    assert "no replay baseline" in capsys.readouterr().err
    state = regression_replay(directory=str(missing), return_state=True)  # as a deployment would run it
    assert state.is_failed() and "no replay baseline" in state.message


def test_record_needs_a_step_count_and_a_fresh_directory(tmp_path, capsys):
    with pytest.raises(ReplayError, match="set trainer.total_training_steps=N"):
        record(str(tmp_path / "b"), overrides=["trainer.total_training_steps=null"])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "baseline.json").write_text("{}")
    assert cli(["replay", "record", "--dir", str(tmp_path / "b"), "trainer.total_training_steps=1"]) == 2
    assert "already holds baseline.json" in capsys.readouterr().err
    assert cli(["replay", "check", "--dir", str(tmp_path / "b"), "--tolerance", "x"]) == 2


# --------------------------------------------------------------------------------------- end to end


@pytest.fixture
def baseline_dir(replay_baseline):
    return replay_baseline


def latest_artifact(key: str):
    from prefect.artifacts import Artifact

    artifact = Artifact.get(key)
    assert artifact is not None, key
    data = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
    return artifact, data


def flow_run_state(flow_run_id):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def generate_states(parent_flow_run_id, expected: int) -> list[str]:
    """Final states of the ``generate`` task runs of the replay's training subflow (states arrive as events)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        TaskRunFilter,
        TaskRunFilterName,
    )

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        subflow = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_flow_run_id]))
        while True:
            runs = client.read_task_runs(
                flow_run_filter=subflow, task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="generate"))
            )
            if (
                len(runs) >= expected and all(run.state and run.state.is_final() for run in runs)
            ) or time.monotonic() > deadline:
                return sorted(run.state.name for run in runs)
            time.sleep(0.5)


def test_record_writes_a_golden_baseline(baseline_dir):
    baseline = json.loads((baseline_dir / "baseline.json").read_text())
    assert baseline["format_version"] == 1 and baseline["config"] == "grpo_tiny" and baseline["steps"] == STEPS
    assert EPOCHS in baseline["overrides"] and not any(word.startswith("skip.") for word in baseline["overrides"])
    assert len(baseline["config_fingerprint"]) == 64 and baseline["code_version"]["ppoflow"]
    assert re.fullmatch(r"[0-9a-f]{40}", baseline["code_version"]["git_commit"] or "0" * 40)
    assert [row["step"] for row in baseline["metrics"]] == [1, 2]
    assert [row["skip/rollout/hit"] for row in baseline["metrics"]] == [0, 0]  # generated, then dumped
    assert baseline["metrics"] == read_metrics(str(baseline_dir / "record"))
    assert sorted(p.parent.name for p in (baseline_dir / "cache").glob("*/*/*/meta.json")) == ["1", "2"]


def test_unchanged_trainer_replays_every_step_from_the_cache_and_passes(prefect, baseline_dir, capsys):
    assert cli(["replay", "check", "--dir", str(baseline_dir)]) == 0
    assert f"all {STEPS} steps match the baseline" in capsys.readouterr().out

    artifact, table = latest_artifact(artifact_key(str(baseline_dir)))
    assert table == [
        {"result": f"all {STEPS} steps match", "steps": STEPS, "metrics_compared": table[0]["metrics_compared"]}
    ]
    assert table[0]["metrics_compared"] > 10 and "same as" in artifact.description
    assert flow_run_state(artifact.flow_run_id).is_completed()
    replays = sorted((baseline_dir / "replays").iterdir())  # named by UTC time
    assert [row["skip/rollout/hit"] for row in read_metrics(str(replays[-1]))] == [1] * STEPS
    assert generate_states(artifact.flow_run_id, STEPS) == ["Cached"] * STEPS  # no generation at all


@pytest.mark.slow
def test_a_changed_loss_fails_the_replay_with_a_table_of_differences(prefect, baseline_dir, capsys):
    assert cli(["replay", "check", "--dir", str(baseline_dir), "--tolerance", "actor/grad_norm=100", *TIGHT_CLIP]) == 1
    out = capsys.readouterr().out
    assert "replay FAILED" in out and re.search(r"^\s*\d+\s+actor/pg_clipfrac\s+\S+\s+\S+\s+\S+\s+0\.0$", out, re.M)

    artifact, table = latest_artifact(artifact_key(str(baseline_dir)))
    assert flow_run_state(artifact.flow_run_id).is_failed()
    assert table and all(
        {"step", "metric", "baseline", "value", "difference", "tolerance"} <= set(row) for row in table
    )
    clipped = [row for row in table if row["metric"] == "actor/pg_clipfrac"]
    assert clipped, table  # tighter clipping clips more tokens once the ratios move (second epoch)
    for row in clipped:
        assert row["value"] > row["baseline"] and row["difference"] == pytest.approx(row["value"] - row["baseline"])
    assert any(row["metric"] == "actor/pg_loss" for row in table)
    assert not any(row["metric"] == "actor/grad_norm" for row in table)  # within its --tolerance
    assert not any(row["metric"].startswith(DEFAULT_IGNORED) for row in table)
    assert "**FAILED**" in artifact.description and "**changed** from" in artifact.description
    replays = sorted((baseline_dir / "replays").iterdir())
    assert [row["skip/rollout/hit"] for row in read_metrics(str(replays[-1]))] == [1] * STEPS  # replayed, not generated


def test_an_incomplete_cache_fails_before_anything_is_generated(prefect, baseline_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(baseline_dir, copy, ignore=shutil.ignore_patterns("replays"))
    (marker,) = (copy / "cache").glob("*/*/2/meta.json")
    marker.unlink()
    state = regression_replay(directory=str(copy), return_state=True)
    assert state.is_failed() and "cache under" in state.message and "is incomplete" in state.message
    assert "step 2" in state.message and not marker.exists() and not (copy / "replays").exists()
