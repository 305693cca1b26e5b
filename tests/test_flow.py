"""End to end: the training flow on a real local Ray and a real Prefect server."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from tests.preflight_helpers import DEMO_TRAIN

STEP_METRICS = [
    "training/global_step",
    "critic/score/mean",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/reward",
    "timing_s/adv",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/step",
    "training/rollout_probs_diff_mean",
]


def _task_runs(flow_run_id, expected: int):
    """The flow run's task runs as the server records them (task states arrive as events, so wait)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200
            )
            settled = all(run.state is not None and run.state.is_final() for run in runs)
            if (settled and len(runs) >= expected) or time.monotonic() > deadline:
                return runs
            time.sleep(0.5)


def _changed_tensors(before_dir: str, after_dir: str) -> int:
    before, after = load_file(f"{before_dir}/model.safetensors"), load_file(f"{after_dir}/model.safetensors")
    assert before.keys() == after.keys()
    return sum(not torch.equal(before[name], after[name]) for name in before)


def test_grpo_flow_runs_every_stage_as_a_task(prefect_api, ray_local, tiny_overrides, tiny_model, tmp_path):
    state = ppo_train(
        config="grpo_tiny", overrides=tiny_overrides + ["trainer.total_training_steps=3"], return_state=True
    )
    assert state.is_completed(), state

    task_runs = _task_runs(
        state.state_details.flow_run_id, expected=2 + 3 * 4 + 3 * 2
    )  # start-up, 4 stages x 3 steps, 3 validations
    names = [run.name.split("[")[0] for run in task_runs]
    assert {run.state.name for run in task_runs} == {"Completed"}
    for stage in ("reward", "advantage", "update_actor"):
        assert names.count(stage) >= 3, f"{stage}: {names.count(stage)} task runs"
    assert names.count("generate") == 3 + 3  # 3 steps; validation before training, at step 2 (test_freq) and at the end
    # one epoch over one mini-batch: the update's own log-probs are the old ones, no separate pass
    assert not {"old_log_prob", "values", "ref_log_prob", "update_critic", "weight_sync"} & set(names)  # colocated

    rows = read_metrics(f"{tmp_path}/run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for name in STEP_METRICS:
        assert all(isinstance(row[name], (int, float)) for row in rows), name
    assert all(row["training/old_log_prob_skipped"] == 1 and "timing_s/old_log_prob" not in row for row in rows)
    assert any(name.startswith("val-core/synthetic/copy/reward/mean@1") for name in rows[1])  # test_freq=2
    assert _changed_tensors(tiny_model, f"{tmp_path}/run/global_step_3/actor/huggingface") > 0


def test_ppo_with_critic_and_kl_terms(prefect_api, ray_local, tiny_overrides, tmp_path):
    overrides = tiny_overrides + [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "trainer.test_freq=-1",
    ]
    state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    names = {run.name.split("[")[0] for run in _task_runs(state.state_details.flow_run_id, expected=2 * 9)}
    assert {"old_log_prob", "values", "ref_log_prob", "update_critic"} <= names  # the KL penalty needs old log-probs
    rows = read_metrics(f"{tmp_path}/run")
    for name in (
        "critic/vf_loss",
        "critic/values/mean",
        "actor/kl_loss",
        "actor/reward_kl_penalty",
        "timing_s/values",
        "timing_s/ref",
        "timing_s/update_critic",
    ):
        assert name in rows[-1], name
    assert rows[0]["actor/reward_kl_penalty_coeff"] != rows[1]["actor/reward_kl_penalty_coeff"]  # adaptive
    # each role process's peak resident memory in the step (a torch process holds more than 50 MiB), the node's
    # memory in use as verl reports it from the actor, and no GPU figures on a CPU run
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    for row in rows:
        for role in ("actor", "ref", "critic"):  # the rollout is the actor's worker (colocated)
            assert 0.05 < row[f"perf/{role}/max_rss_gb"] < total, role
        assert row["perf/actor/max_rss_gb"] < row["perf/cpu_memory_used_gb"] < total
        assert not any(name.startswith("perf/rollout/") or "max_memory_" in name for name in row)
        assert row["perf/actor/rollout_sleep_after_gb"] > 0  # its engine, asleep while the actor trains


@pytest.mark.slow
def test_cli_rejects_bad_config_before_starting_anything():
    result = subprocess.run(
        [
            *DEMO_TRAIN,
            "actor_rollout_ref.rollout.temprature=0.5",
            "data.train_batch_size=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        "actor_rollout_ref.rollout.temprature: unknown key; did you mean 'actor_rollout_ref.rollout.temperature'"
        in result.stderr
    )
    assert "data.train_batch_size" in result.stderr and "(got 0)" in result.stderr
    assert "Ray" not in result.stderr and "prefect" not in result.stderr.lower()


@pytest.mark.slow
def test_cli_explains_a_temporary_server_that_cannot_start(tmp_path):
    # A database migrated by a Prefect this one does not know: its temporary server cannot start.
    with sqlite3.connect(tmp_path / "prefect.db") as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        db.execute("INSERT INTO alembic_version VALUES ('ffffffffffff')")
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "8"}
    result = subprocess.run(
        [
            *DEMO_TRAIN,
            f"trainer.default_local_dir={tmp_path}/run",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "The temporary Prefect server did not start. Run `prefect server start` to see why" in result.stderr


@pytest.mark.slow  # a CLI run with a Ray of its own (~17 s)
def test_the_cli_reports_roles_the_cluster_cannot_hold_as_bad_input(prefect_server, tiny_overrides):
    """Found only once Ray runs, inside the flow run: still exit 2 and one message naming the key, no traceback."""
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    result = subprocess.run(
        [
            *DEMO_TRAIN,
            *tiny_overrides,
            "trainer.n_cpu_ranks_per_node=4",
            "ray.num_cpus=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "PREFECT_API_URL": prefect_server},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        "\nppoflow: invalid configuration (1 problem):\n  actor_rollout_ref.actor.resources.num_cpus: the roles "
        "need 4 CPU but the Ray cluster has 2" in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.actor.resources.num_cpus=64", "the roles need"),
        # eight actor ranks of one CPU each (each hosting its rollout engine), on a Ray of four: the error names
        # the ranks and the cluster's total
        (
            "trainer.n_cpu_ranks_per_node=8",
            r"actor_rollout_ref.actor.resources.num_cpus: the roles need 8 CPU but the Ray "
            r"cluster has 4 \(actor_rollout_ref.actor \(8 ranks\): 8\)",
        ),
        ("data.max_response_length=80", "max_position_embeddings"),
        # a run started from the UI or a deployment fails with the preflight's message, naming the key
        ("custom_reward_function.path=ppoflow_no_such_module", "custom_reward_function.path: cannot import"),
    ],
)
def test_impossible_runs_fail_before_training(prefect_api, ray_local, tiny_overrides, override, message):
    state = ppo_train(config="grpo_tiny", overrides=tiny_overrides + [override], return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=message):
        state.result()


def test_a_steps_independent_forward_passes_run_side_by_side(prefect_api, monkeypatch):
    """The reference and value passes of a step read the same batch and not each other's result: they are
    task runs of their own, submitted together, so both run at once (each meets the other at a barrier,
    which a one-after-the-other call would leave waiting), and both results reach the step with timings."""
    import dataclasses
    import threading

    from prefect import flow
    from tensordict import TensorDict

    from ppoflow.flows.stages import RolloutOrigin, StageCall, Stages, StepData
    from ppoflow.storage.batch import StageResult
    from ppoflow.tasks.stages import REF_LOG_PROB, VALUES
    from ppoflow.tasks.task_inputs import recorded_task

    both_running = threading.Barrier(2, timeout=30)

    def meets_the_other(workers, batch_ref, field: str) -> StageResult:
        both_running.wait()  # BrokenBarrierError unless the other pass runs at the same time
        return StageResult(TensorDict({field: torch.ones(2, 3)}, batch_size=[2]))

    calls = [
        StageCall(dataclasses.replace(stage, task=recorded_task(name=stage.name)(meets_the_other)), arguments)
        for stage, arguments in (
            (REF_LOG_PROB, {"workers": None, "batch_ref": None, "field": "ref_log_probs"}),
            (VALUES, {"workers": None, "batch_ref": None, "field": "values"}),
        )
    ]
    step = StepData(3, batch=TensorDict({"responses": torch.zeros(2, 3, dtype=torch.long)}, batch_size=[2]))
    stages = Stages(workers=None, caches={}, orchestrated=True, rollout=RolloutOrigin("m", "m", "bfloat16", None))

    @flow
    def forward_passes() -> None:
        stages.together(step, calls)

    state = forward_passes(return_state=True)
    assert state.is_completed()
    assert {"ref_log_probs", "values"} <= set(step.batch.keys())
    assert step.metrics["timing_s/ref"] > 0 and step.metrics["timing_s/values"] > 0
    names = sorted(run.name for run in _task_runs(state.state_details.flow_run_id, 2))
    assert names == ["ref_log_prob[step=3]", "values[step=3]"]
