"""Checkpoint and resume: an interrupted run continues exactly where an uninterrupted one goes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from ppoflow.storage import checkpoint
from tests.preflight_helpers import DEMO_TRAIN

pytestmark = pytest.mark.reliability

COMPARED = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "critic/advantages/mean",
    "response_length/mean",
    "training/epoch",
    "training/off_policy/trajectory_staleness/max",
)

SLOW_SCORER = """
import time
from ppoflow.algorithms.scoring import copy_score

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.01)  # widen each step so the test can kill the run in the middle of one
    return copy_score(data_source, solution_str, ground_truth, extra_info)
"""


@pytest.fixture
def overrides(tiny_overrides, tmp_path):
    words = [w for w in tiny_overrides if not w.startswith(("trainer.", "data.val_files", "data.synthetic.train_rows"))]
    # 24 rows / 4 per step: step 4 starts a new epoch, so the dataloader position is resumed across it
    return words + [
        "data.val_files=null",
        "data.synthetic.train_rows=12",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=4",
    ]


def rows_by_step(run_dir) -> dict[int, dict]:
    return {row["step"]: row for row in read_metrics(str(run_dir))}


def assert_same_steps(straight: dict, resumed: dict, steps) -> None:
    for step in steps:
        for name in COMPARED + tuple(name for name in ("critic/vf_loss", "actor/kl_loss") if name in straight[step]):
            assert straight[step][name] == resumed[step][name], (step, name)


TWO_RANKS = [
    "trainer.n_cpu_ranks_per_node=2",
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.resources.num_cpus=0.5",
    "actor_rollout_ref.ref.resources.num_cpus=0.5",
    "critic.resources.num_cpus=0.5",
]
"""Actor, reference and critic as two data-parallel ranks each (half a CPU per rank: they fit the test's Ray);
their checkpoints are shards written by both ranks."""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [[], TWO_RANKS], ids=["one rank", "two ranks of actor, ref and critic"])
def test_sync_run_resumes_from_its_checkpoint_bit_for_bit(prefect_api, ray_local, overrides, tmp_path, ranks):
    overrides = overrides + ranks
    ppo_train(config="grpo_tiny", overrides=overrides + [f"trainer.default_local_dir={tmp_path}/straight"])
    # the same run, stopped after step 2 (its last checkpoint), then started again for 4 steps
    interrupted = overrides + [f"trainer.default_local_dir={tmp_path}/resumed", "trainer.save_freq=2"]
    ppo_train(config="grpo_tiny", overrides=interrupted + ["trainer.total_training_steps=2"])
    assert checkpoint.latest(f"{tmp_path}/resumed").endswith("global_step_2")
    ppo_train(config="grpo_tiny", overrides=interrupted)
    resumed = rows_by_step(tmp_path / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert_same_steps(rows_by_step(tmp_path / "straight"), resumed, [1, 2, 3, 4])
    assert resumed[4]["training/epoch"] == 1


def test_incomplete_checkpoints_are_never_chosen(tmp_path):
    run_dir = tmp_path / "run"
    complete = checkpoint.commit(str(run_dir), 2, {}, {"global_step": 2})
    (run_dir / "global_step_3").mkdir()
    (run_dir / "global_step_3" / "trainer_state.json").write_text("{}")  # a crash before the marker
    (run_dir / "global_step_4").mkdir()
    entry = checkpoint.write_file(str(run_dir / "global_step_4" / "actor" / "model.safetensors"), b"x" * 100)
    checkpoint.commit(str(run_dir), 4, {"actor/model.safetensors": entry}, {"global_step": 4})
    (run_dir / "global_step_4" / "actor" / "model.safetensors").write_bytes(b"x" * 10)  # truncated later
    assert checkpoint.latest(str(run_dir)) == complete
    assert checkpoint.read_trainer_state(complete)[1] == {"global_step": 2}
    with pytest.raises(checkpoint.CheckpointError, match="global_step_3"):
        checkpoint.read_trainer_state(str(run_dir / "global_step_3"))


def kill_after_step_2_and_restart(ray_local, common: list[str], tmp_path, capsys) -> tuple[dict, dict]:
    """Run ``common`` straight, then as ``ppoflow train`` killed with SIGKILL once its step-2 checkpoint is
    committed (during step 3) and started again; both runs' metrics by step."""
    ppo_train(config="grpo_tiny", overrides=common + [f"trainer.default_local_dir={tmp_path}/straight"])

    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    command = [
        *DEMO_TRAIN,
        *common,
        f"trainer.default_local_dir={tmp_path}/killed",
    ]
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = Path(tmp_path / "killed" / "global_step_2" / checkpoint.MARKER)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert first.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert not (tmp_path / "killed" / "global_step_3" / checkpoint.MARKER).exists()
    assert max(rows_by_step(tmp_path / "killed")) <= 3

    capsys.readouterr()
    second = ppo_train(
        config="grpo_tiny", overrides=common + [f"trainer.default_local_dir={tmp_path}/killed"], return_state=True
    )  # started again (here in-process; a UI retry does the same)
    assert second.is_completed(), second
    assert "global_step_2: continuing at step 3" in capsys.readouterr().out  # resumed, not started over
    return rows_by_step(tmp_path / "straight"), rows_by_step(tmp_path / "killed")


@pytest.mark.slow
def test_sigkill_mid_step_then_restart_resumes_one_step_off(prefect_api, ray_local, overrides, tmp_path, capsys):
    """A one_step_off run killed with SIGKILL during step 3 restarts from checkpoint 2 (with the batch
    that was being generated for step 3) and reproduces the uninterrupted run."""
    (tmp_path / "slow_scorer.py").write_text(SLOW_SCORER)
    common = overrides + [
        f"custom_reward_function.path={tmp_path}/slow_scorer.py",
        "trainer.mode=one_step_off",
        "trainer.save_freq=1",
    ]
    straight, resumed = kill_after_step_2_and_restart(ray_local, common, tmp_path, capsys)
    assert sorted(resumed) == [1, 2, 3, 4]
    assert_same_steps(straight, resumed, [1, 2, 3, 4])
    marker = tmp_path / "killed" / "global_step_2" / checkpoint.MARKER
    state = json.loads((tmp_path / "killed" / "global_step_2" / "trainer_state.json").read_text())
    in_flight = "mode.in_flight.3.safetensors"  # the batch generated for step 3, written beside the state
    assert state["global_step"] == 2 and in_flight in json.loads(marker.read_text())["files"]
    assert state["mode"]["in_flight"]["3"] == {"batch_file": in_flight}


@pytest.mark.slow
def test_sigkill_of_two_colocated_ranks_then_restart_resumes_bit_for_bit(
    prefect_api, ray_local, overrides, tmp_path, capsys
):
    """verl's layout at W=2 (each actor rank generating its share, asleep while they train) killed with SIGKILL
    during step 3: restarted from the shards both ranks wrote at step 2, it reproduces the uninterrupted run."""
    (tmp_path / "slow_scorer.py").write_text(SLOW_SCORER)
    common = overrides + [
        f"custom_reward_function.path={tmp_path}/slow_scorer.py",
        "trainer.n_cpu_ranks_per_node=2",
        "actor_rollout_ref.hybrid_engine=true",
        "actor_rollout_ref.actor.resources.num_cpus=0.5",
        "trainer.save_freq=1",
    ]
    straight, resumed = kill_after_step_2_and_restart(ray_local, common, tmp_path, capsys)
    assert sorted(resumed) == [1, 2, 3, 4]
    assert_same_steps(straight, resumed, [1, 2, 3, 4])
    files = json.loads((tmp_path / "killed" / "global_step_2" / checkpoint.MARKER).read_text())["files"]
    assert "actor/shard-00002-model-00001-of-00001.safetensors" in files  # written by the second rank


@pytest.mark.slow
def test_resume_survives_a_corrupt_newest_checkpoint_and_a_torn_metrics_line(
    prefect_api, ray_local, overrides, tmp_path, caplog, capsys
):
    """Damage a finished 3-step run the way a crash or a bad disk does, then resume it to 4 steps."""
    run_dir = tmp_path / "run"
    words = overrides + [f"trainer.default_local_dir={run_dir}", "trainer.save_freq=1"]
    ppo_train(config="grpo_tiny", overrides=words + ["trainer.total_training_steps=3"])
    weights = run_dir / "global_step_3" / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(255 - byte for byte in data[-64:])  # same size: only the sha256 can tell
    weights.write_bytes(bytes(data))
    metrics = run_dir / "metrics.jsonl"
    torn = metrics.read_bytes()[:-20]  # the last row (step 3) loses its end, as in a power loss mid-append
    metrics.write_bytes(torn)

    capsys.readouterr()
    ppo_train(config="grpo_tiny", overrides=words + ["trainer.total_training_steps=4"])
    assert f"not resuming from checkpoint {run_dir}/global_step_3: {weights}: checksum" in caplog.text
    assert f"resumed from {run_dir}/global_step_2: continuing at step 3" in capsys.readouterr().out
    (aside,) = run_dir.glob("metrics.discarded-*.jsonl")
    assert aside.read_bytes() == torn.splitlines(keepends=True)[-1] + b"\n"  # the torn line, set aside
    assert [row["step"] for row in read_metrics(str(run_dir))] == [1, 2, 3, 4]
