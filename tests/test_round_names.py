"""Each sample-and-update round of a step has task runs named for it: separate_async runs
``parameter_sync_step`` rounds a step, the first named ``<stage>[step=N]``, the later ones
``<stage>[step=N/<round>]``, so that the Task Runs list tells them apart."""

from __future__ import annotations

import pytest

from ppoflow.flows.stages import StepData
from tests.async_modes_helpers import run_overrides
from tests.flow_runs import task_runs_by_name


def test_a_rounds_label():
    assert [StepData(3, round=r).label for r in (0, 1, 2)] == ["step=3", "step=3/1", "step=3/2"]


@pytest.mark.slow  # a run of several rounds (~13 s); StepData's labels are unit-tested above
def test_every_round_of_a_step_has_task_runs_of_its_own(prefect_api, ray_local, tiny_model, tmp_path):
    from ppoflow.flows.train import ppo_train

    words = [
        "trainer.v1.trainer_mode=separate_async",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "trainer.total_training_steps=1",
    ]
    state = ppo_train(config="grpo_tiny", overrides=run_overrides(tiny_model, tmp_path, *words), return_state=True)
    assert state.is_completed(), state
    stages = ("sample", "old_log_prob", "advantage", "update_actor")  # scored as it sampled: no reward task
    names = [f"{stage}[{label}]" for stage in stages for label in ("step=1", "step=1/1")]
    runs = task_runs_by_name(state.state_details.flow_run_id, names)
    assert all(runs[name].state.is_completed() for name in names)
    # the second round's advantage is computed from the second round's batch, not the first's
    assert [link.id for link in runs["advantage[step=1/1]"].task_inputs["batch"]] == [runs["old_log_prob[step=1/1]"].id]
