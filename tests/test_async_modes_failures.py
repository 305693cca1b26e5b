"""Async runs that fail on a real local Ray and Prefect: a custom scorer that raises in the rollout service (the
run scores on), one that hangs, and an agent loop that fails on every prompt, each stopping the run once with one
line."""

from __future__ import annotations

import pytest

from tests.async_modes_helpers import run_overrides
from tests.preflight_helpers import DEMO_TRAIN

PASSES_THE_PREFLIGHT_ONLY = """
import time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls = Path(__file__).with_suffix(".calls")
    calls.write_text(calls.read_text() + "." if calls.exists() else ".")
    if len(calls.read_text()) > 1:  # the preflight's call passes; the rollout's do not
        {then}
    return 0.0
"""
"""A custom scorer that passes the preflight's call, then does ``then`` on every call."""


@pytest.mark.slow  # ~40 s of a CLI run each, these three
def test_an_async_run_whose_scorer_fails_scores_on(prefect_server, tiny_model, tmp_path):
    """A custom scorer failing in the rollout service (async scoring) on every response: each scores
    custom_reward_function.error_score, counted in reward/scorer_errors, and the run ends as a success."""
    import subprocess

    from ppoflow.flows.tracking import read_metrics

    failing = PASSES_THE_PREFLIGHT_ONLY.format(then='raise RuntimeError("the judge is down")')
    (tmp_path / "scorer.py").write_text(failing)
    words = ["trainer.v1.trainer_mode=colocate_async", f"custom_reward_function.path={tmp_path}/scorer.py"]
    done = subprocess.run(
        [
            *DEMO_TRAIN,
            *run_overrides(tiny_model, tmp_path, *words),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(f"{tmp_path}/run")
    assert len(rows) == 3 and all(row["reward/scorer_errors"] > 0 for row in rows), rows


@pytest.mark.slow
def test_a_scorer_past_its_deadline_in_the_rollout_service_fails_generate_once(
    prefect_api, ray_local, tiny_model, tmp_path
):
    """A sync run whose async rollout scores as it samples: a scorer past custom_reward_function.timeout_s
    fails the generate task run once (never retried: run_count 1) and the run with ScorerTimedOut."""
    from ppoflow.algorithms.scoring import ScorerTimedOut
    from ppoflow.flows.train import ppo_train
    from tests.flow_runs import task_runs_by_name

    (tmp_path / "scorer.py").write_text(PASSES_THE_PREFLIGHT_ONLY.format(then="time.sleep(10**9)"))
    words = [
        f"custom_reward_function.path={tmp_path}/scorer.py",
        "custom_reward_function.timeout_s=1",
        "trainer.total_training_steps=1",
    ]
    overrides = run_overrides(tiny_model, tmp_path, *words)
    state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(ScorerTimedOut, match="custom_reward_function.timeout_s=1 s"):
        state.result()
    generate = task_runs_by_name(state.state_details.flow_run_id, ["generate[step=1]"])["generate[step=1]"]
    assert generate.state.is_failed() and generate.run_count == 1


BROKEN_LOOP = """
from ppoflow.workers.service.agent_loop import AgentLoop

class Broken(AgentLoop):
    async def run(self, sampling, **row):
        raise RuntimeError("the loop is broken")
"""


@pytest.mark.slow
def test_an_async_run_whose_every_generation_fails_stops(prefect_server, tiny_model, tmp_path):
    """An agent loop that raises on every prompt: the buffer evicts and refills each failed group, until two
    batches' worth have failed in a row; then the run stops with one line and exit 1, naming the last error."""
    import os
    import subprocess

    (tmp_path / "broken_loops.py").write_text(BROKEN_LOOP)
    (tmp_path / "loops.yaml").write_text("- name: broken_agent\n  _target_: broken_loops.Broken\n")
    words = [
        "trainer.v1.trainer_mode=colocate_async",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
        "actor_rollout_ref.rollout.agent.default_agent_loop=broken_agent",
    ]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [
            *DEMO_TRAIN,
            *run_overrides(tiny_model, tmp_path, *words),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "ppoflow: the run failed: the last 8 prompt groups generated all failed, the last with "
        "RuntimeError('the loop is broken')"
    ), done.stderr[-3000:]
