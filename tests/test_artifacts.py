"""A run's Prefect artifacts (progress, metrics table, markdown summary) and its reward-curve PNG."""

from __future__ import annotations

import json
import time

import torch
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from prefect.runtime import flow_run
from tensordict import TensorDict

from ppoflow.configs import load_config
from ppoflow.flows import artifacts as artifacts_module
from ppoflow.flows.artifacts import RunArtifacts, metrics_table, reward_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LATEST = "ppoflow-art-test-1-latest"
SLUG = "ppoflow-art-test-1-art-run"
ROWS = [
    {
        "step": 1,
        "critic/score/mean": 0.123456,
        "critic/rewards/mean": 0.1,
        "actor/pg_loss": -0.0123456,
        "actor/grad_norm": 1.5,
        "actor/entropy": 2.0,
        "response_length/mean": 3.0,
        "timing_s/step": 0.98765,
        "timing_s/gen": 0.012345,
        "timing_s/update_actor": 0.5,
        "training/off_policy/trajectory_staleness/mean": 0.0,
        "training/off_policy/trajectory_staleness/max": 0.0,
        "agent/num_turns/mean": 1.5,
        "agent/tool_calls/mean": 0.25,
        "agent/tool_errors/count": 0.0,
        "agent/tool_call_ratio": 0.25,
    },
    {
        "step": 2,
        "critic/score/mean": 0.25,
        "critic/rewards/mean": 0.2,
        "actor/pg_loss": 0.01,
        "actor/grad_norm": 1.25,
        "actor/entropy": 1.9,
        "response_length/mean": 3.0,
        "timing_s/step": 0.9,
        "timing_s/gen": 0.2,
        "timing_s/update_actor": 0.375,
        "training/off_policy/trajectory_staleness/mean": 1 / 3,
        "training/off_policy/trajectory_staleness/max": 1.0,
        "agent/num_turns/mean": 2.0,
        "agent/tool_calls/mean": 0.5,
        "agent/tool_errors/count": 1.0,
        "agent/tool_call_ratio": 0.5,
    },
    {
        "step": 3,
        "critic/score/mean": 0.5,
        "critic/rewards/mean": 0.4,
        "actor/pg_loss": None,
        "actor/grad_norm": 1.0,
        "actor/entropy": 1.8,
        "response_length/mean": 2.5,
        "timing_s/step": 0.8,
        "timing_s/gen": 0.25,
        "timing_s/update_actor": 0.25,
        "training/off_policy/trajectory_staleness/mean": 1.0,
        "training/off_policy/trajectory_staleness/max": 2.0,
        "agent/num_turns/mean": 2.5,
        "agent/tool_calls/mean": 0.75,
        "agent/tool_errors/count": 0.0,
        "agent/tool_call_ratio": 0.75,
        "val-core/copy/reward/mean@1": 0.375,
    },
]
"""Three steps of a multi-turn off-policy run as metrics.jsonl holds them (staleness as in :data:`VERSIONS`)."""


VERSIONS = [([0, 0, 0], [0, 0, 0]), ([0, 0, 1], [0, 1, 1]), ([0, 1, 2], [0, 1, 2])]
"""Per step, the oldest and newest weight versions of three samples: staleness 0,0,0 | 1,0,0 | 2,1,0."""
ON_POLICY = [([0, 0, 0], [0, 0, 0]), ([1, 1, 1], [1, 1, 1]), ([2, 2, 2], [2, 2, 2])]
"""A sync run's: every sample drawn with the weights it trains."""
CACHE_LINES = ["3 of 3 planned steps replayed", "* step 2: `generate` rejected (checksum mismatch)"]


def config(tmp_path):
    return load_config("grpo_tiny", ["trainer.experiment_name=Art Test_1", f"trainer.default_local_dir={tmp_path}/run"])


@flow(flow_run_name="art-run")
def publish(cfg, versions=VERSIONS, cache_lines=()) -> tuple[str, str]:
    artifacts = RunArtifacts(cfg, total_steps=3)
    artifacts.validated_before_training({"val-core/copy/reward/mean@1": 0.125})
    for row, (oldest, newest) in zip(ROWS, versions):
        artifacts.step(
            row["step"],
            row,
            TensorDict(
                {"weight_version": torch.tensor(oldest), "max_weight_version": torch.tensor(newest)}, batch_size=[3]
            ),
        )
    png = artifacts.finish(
        ROWS,
        checkpoint=f"{cfg.trainer.default_local_dir}/global_step_2",
        final_model=f"{cfg.trainer.default_local_dir}/global_step_3/actor/huggingface",
        caches=["/caches/rollout", "/caches/reward"],
        cache_lines=list(cache_lines),
    )
    return flow_run.id, png


WANTED = {f"{SLUG}-progress", f"{SLUG}-metrics", f"{SLUG}-summary", f"{SLUG}-config", f"{SLUG}-staleness", LATEST}


def read_back(flow_run_id: str, wanted: set[str] = WANTED) -> dict:
    """The flow run's artifacts by key (polled briefly: they reach the API asynchronously); ``wanted`` are
    all it published: another key of the run fails the test."""
    with get_client(sync_client=True) as client:
        for _ in range(50):
            found = {
                artifact.key: artifact
                for artifact in client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
                )
            }
            if set(found) >= wanted and found[f"{SLUG}-progress"].data == 100:
                assert set(found) == wanted, sorted(found)
                return found
            time.sleep(0.1)
    raise AssertionError(f"artifacts of flow run {flow_run_id}: {sorted(found)}")


def test_a_run_publishes_progress_table_summary_and_reward_curve(prefect_api, tmp_path):
    cfg = config(tmp_path)
    flow_run_id, png = publish(cfg)
    found = read_back(flow_run_id)

    assert found[f"{SLUG}-progress"].type == "progress"
    table = json.loads(found[f"{SLUG}-metrics"].data)
    assert [row["step"] for row in table] == [1, 2, 3]
    assert table[0] == {
        "step": 1,
        "score": 0.1235,
        "rewards": 0.1,
        "pg_loss": -0.01235,
        "grad_norm": 1.5,
        "entropy": 2.0,
        "response_length": 3.0,
        "staleness": 0.0,
        "staleness_max": 0.0,
        "turns": 1.5,
        "tool_calls": 0.25,
        "tool_errors": 0.0,
        "step_s": 0.988,
        "gen_s": 0.0123,
        "update_actor_s": 0.5,
        "val/copy/reward/mean@1": "",
    }
    assert table[1]["staleness"] == 0.3333 and table[1]["tool_errors"] == 1.0
    assert table[2]["pg_loss"] == "" and table[2]["val/copy/reward/mean@1"] == 0.375

    summary = found[f"{SLUG}-summary"].data
    run_dir = cfg.trainer.default_local_dir
    for text in (
        run_dir,
        f"{run_dir}/global_step_2`",
        f"{run_dir}/global_step_3/actor/huggingface",
        "/caches/rollout",
        "/caches/reward",
        "data:image/png;base64,",
        png,
        "Art Test_1",
        "grpo",
        f"{SLUG}-config",
        "| turns | 2.5 |",
        "| tool_calls | 0.75 |",
        "| staleness_max | 2.0 |",
        "| step_s | 0.8 |",
    ):
        assert text in summary, text
    assert "```yaml" not in summary and "<details>" not in summary and "Step cache" not in summary
    assert "gen_s" not in summary  # the stage timings are in the table, not the headline
    assert "```yaml" in found[f"{SLUG}-config"].data
    assert "latest run `art-run`" in found[LATEST].data
    staleness = found[f"{SLUG}-staleness"].data
    assert "| 0 | 6 | 66.7% |" in staleness and "| 1 | 2 | 22.2% |" in staleness and "| 2 | 1 | 11.1% |" in staleness

    assert png == f"{tmp_path}/run/reward_curve.png"
    assert (tmp_path / "run" / "reward_curve.png").read_bytes().startswith(PNG_SIGNATURE)


def test_a_run_without_off_policy_samples_has_no_staleness_artifact(prefect_api, tmp_path):
    """A sync run trains on-policy only: a histogram would say "0: 100%"; the step cache's lines are a
    section of the summary, as given."""
    flow_run_id, _ = publish(config(tmp_path), versions=ON_POLICY, cache_lines=CACHE_LINES)
    found = read_back(flow_run_id, WANTED - {f"{SLUG}-staleness"})
    summary = found[f"{SLUG}-summary"].data
    section = summary[summary.index("## Step cache") :]
    assert section.startswith("\n".join(["## Step cache", "", *CACHE_LINES, ""]))


def test_the_table_has_only_the_columns_some_row_has():
    rows = [
        {"step": 1, "critic/score/mean": 0.5, "timing_s/step": 0.25, "timing_s/gen": 0.00123456},
        {"step": 2, "critic/score/mean": 0.75, "timing_s/step": 1.2345, "timing_s/reward": 0.5},
    ]
    assert metrics_table(rows) == [
        {"step": 1, "score": 0.5, "step_s": 0.25, "gen_s": 0.00123, "reward_s": ""},
        {"step": 2, "score": 0.75, "step_s": 1.23, "gen_s": "", "reward_s": 0.5},
    ]
    assert metrics_table(rows, stage_timings=False)[1] == {"step": 2, "score": 0.75, "step_s": 1.23}


@flow(flow_run_name="quick-run")
def quick_steps(cfg, steps: int) -> str:
    artifacts = RunArtifacts(cfg, total_steps=steps)
    for step in range(1, steps + 1):
        artifacts.step(step, {})
    return flow_run.id


def test_the_progress_is_updated_at_most_once_a_second_and_after_the_last_step(prefect_api, tmp_path, monkeypatch):
    """Each update is a request the flow's thread waits for: 50 steps done within a second or so update
    the progress after the first step and after the last, not after each."""
    sent = []
    update = artifacts_module.update_progress_artifact
    monkeypatch.setattr(
        artifacts_module, "update_progress_artifact", lambda **call: sent.append(call["progress"]) or update(**call)
    )
    flow_run_id = quick_steps(config(tmp_path), 50)

    assert sent[0] == 2.0 and sent[-1] == 100.0
    assert len(sent) < 10  # one a second at most (a slow machine may take a few seconds)
    key = "ppoflow-art-test-1-quick-run-progress"
    with get_client(sync_client=True) as client:
        for _ in range(50):
            [progress] = client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=[key])
                )
            )
            if progress.data == 100:
                break
            time.sleep(0.1)
    assert progress.data == 100


def test_outside_a_flow_run_only_the_png_is_written(tmp_path):
    artifacts = RunArtifacts(config(tmp_path), total_steps=3)
    artifacts.step(1, ROWS[0])
    png = artifacts.finish(ROWS[:1], checkpoint=None, final_model=None, caches=[])
    assert not artifacts.active
    assert open(png, "rb").read().startswith(PNG_SIGNATURE)


def test_the_reward_curve_plots_validation_from_step_0():
    figure = reward_figure([{"step": 0, "val-core/copy/reward/mean@1": 0.125}, *ROWS], "title")
    lines = {line.get_label(): list(line.get_xdata()) for line in figure.axes[0].lines}
    assert lines == {"train score": [1, 2, 3], "val copy/reward/mean@1": [0, 3]}
