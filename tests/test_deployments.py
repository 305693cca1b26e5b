"""Deployments against a real Prefect server: served from a subprocess, triggered as the UI does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def client():
    from prefect import get_client

    return get_client(sync_client=True)


def wait_for_deployments(names: list[str], timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    with client() as api:
        while True:
            found = {}
            for name in names:
                try:
                    found[name] = api.read_deployment_by_name(name)
                except Exception:  # ObjectNotFound until the serve process has registered it
                    break
            if len(found) == len(names):
                return found
            assert time.monotonic() < deadline, f"deployments {names} were not registered"
            time.sleep(1)


def artifact_keys(flow_run_id) -> set[str]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with client() as api:
        artifacts = api.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {artifact.key for artifact in artifacts}


def test_the_training_form_starts_from_the_presets_values():
    import yaml

    from ppoflow.flows.deploy import deployments, form_defaults

    grpo_tiny = {"config": "grpo_tiny", "experiment_name": "grpo_tiny", "total_training_steps": 200, "mode": "sync"}
    assert form_defaults() == grpo_tiny
    assert deployments("regression/golden")[0].parameters == grpo_tiny  # what `ppoflow serve` registers
    declared = {d["name"]: d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    assert declared["ppo-train"]["parameters"] == grpo_tiny  # and `prefect deploy`
    assert form_defaults("vault_tool") == {
        "config": "vault_tool",
        "experiment_name": "vault_tool",
        "total_training_steps": 500,
        "mode": "sync",
    }


def test_serving_a_config_that_does_not_load_exits_2_naming_it(capsys):
    from ppoflow.flows.cli import main

    assert main(["serve", "--config", "no_such_preset"]) == 2  # before anything is registered or served
    assert "no_such_preset" in capsys.readouterr().err


@pytest.fixture
def small(tiny_overrides):
    return [w for w in tiny_overrides if not w.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
    ]


@pytest.mark.slow
def test_served_deployments_run_with_ui_parameters(prefect_api, ray_local, small, replay_baseline, tmp_path):
    from prefect.deployments import run_deployment

    from ppoflow.flows.deploy import form_defaults

    golden = replay_baseline
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    server = subprocess.Popen(
        [sys.executable, "-m", "ppoflow.flows.cli", "serve", "--replay-dir", str(golden), "--limit", "1"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deployments = wait_for_deployments(["ppo-train/ppo-train", "regression-replay/regression-replay"])
        replay = deployments["regression-replay/regression-replay"]
        assert [schedule.schedule.cron for schedule in replay.schedules] == ["0 3 * * *"]
        form = deployments["ppo-train/ppo-train"].parameter_openapi_schema["properties"]
        assert form["mode"]["anyOf"][0]["enum"] == ["sync", "one_step_off", "colocate_async", "separate_async"]
        assert form["overrides"]["description"]
        assert deployments["ppo-train/ppo-train"].parameters == form_defaults()  # the form shows what a run uses

        run = run_deployment(
            "ppo-train/ppo-train",
            timeout=600,
            poll_interval=1,
            parameters={
                "overrides": small + [f"trainer.default_local_dir={tmp_path}/ui-run"],
                "total_training_steps": 2,
                "experiment_name": "from-the-ui",
                "mode": "one_step_off",
            },
        )
        assert run.state.is_completed(), run.state
        with client() as api:  # a run from the form tags itself as a CLI run is created tagged
            assert {"experiment:from-the-ui", "preset:grpo_tiny", "mode:one_step_off"} <= set(
                api.read_flow_run(run.id).tags
            )
        keys = artifact_keys(run.id)  # <project>-<experiment>-<flow run name>-<what>, and the experiment's -latest
        assert "ppoflow-from-the-ui-latest" in keys
        for what in ("progress", "metrics", "summary", "config"):
            assert any(key.startswith("ppoflow-from-the-ui-") and key.endswith(f"-{what}") for key in keys), (
                what,
                keys,
            )
        assert (tmp_path / "ui-run" / "reward_curve.png").exists()

        with pytest.raises(Exception, match="total_training_steps"):  # the server validates the form's constraints
            run_deployment("ppo-train/ppo-train", timeout=0, parameters={"total_training_steps": 0})

        checked = run_deployment("regression-replay/regression-replay", timeout=600, poll_interval=1)  # as scheduled
        assert checked.state.is_completed(), checked.state
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.mark.slow
def test_prefect_yaml_deploys_both_deployments_to_a_work_pool(prefect_api, tmp_path):
    env = {**os.environ, "PPOFLOW_REPO": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "prefect", "work-pool", "create", "ppoflow-local", "--type", "process"],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    deployed = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    deployments = wait_for_deployments(["ppo-train/ppo-train", "regression-replay/regression-replay"], timeout=30)
    assert {d.work_pool_name for d in deployments.values()} == {"ppoflow-local"}
    assert [s.schedule.cron for s in deployments["regression-replay/regression-replay"].schedules] == ["0 3 * * *"]


def test_a_bad_override_fails_the_run_at_once_naming_the_key(prefect_api):
    from ppoflow.flows.train import ppo_train

    state = ppo_train(overrides=["actor_rollout_ref.rollout.temprature=0.5"], return_state=True)
    assert state.is_failed() and "did you mean 'actor_rollout_ref.rollout.temperature'" in state.message


def test_serve_registers_the_nightly_replay_inactive_when_there_is_no_golden_baseline(prefect_api, tmp_path, capsys):
    from ppoflow.flows.deploy import deployments

    missing = str(tmp_path / "no-golden")
    replay = next(d for d in deployments(missing) if d.name == "regression-replay")
    assert f"--replay-dir {missing} holds no baseline.json" in capsys.readouterr().err
    replay.apply()
    with client() as api:
        registered = api.read_deployment_by_name("regression-replay/regression-replay")
    assert [(s.schedule.cron, s.active) for s in registered.schedules] == [("0 3 * * *", False)]


def test_a_golden_baseline_keeps_the_nightly_replay_active(replay_baseline, capsys):
    from ppoflow.flows.deploy import deployments

    replay = next(d for d in deployments(str(replay_baseline)) if d.name == "regression-replay")
    assert [schedule.active for schedule in replay.schedules] == [True]
    assert "warning" not in capsys.readouterr().err


def test_a_recorded_run_is_named_for_its_experiment_and_tagged(prefect_api, replay_baseline):
    """``ppoflow replay record`` trains through the same call as ``ppoflow train``: the flow run is named
    ``<experiment>-<time>``, created with its tags, and its Parameters show the effective typed fields."""
    import re

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterTags

    from tests.conftest import REPLAY_STEPS

    with client() as api:
        (run,) = api.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["record"])))
        task_runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])), limit=5)
    assert re.fullmatch(r"grpo_tiny-\d{8}-\d{6}", run.name), run.name
    assert set(run.tags) == {"experiment:grpo_tiny", "preset:grpo_tiny", "mode:sync", "record"}
    assert {name: run.parameters[name] for name in ("experiment_name", "mode", "total_training_steps")} == {
        "experiment_name": "grpo_tiny",
        "mode": "sync",
        "total_training_steps": REPLAY_STEPS,
    }
    assert task_runs and all(task.tags == [] for task in task_runs)  # the run's tags are not every task run's
