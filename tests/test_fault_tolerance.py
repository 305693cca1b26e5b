"""A rollout worker killed in the middle of a generation is restarted, its step is generated again with
the weights it was started with, and the run ends as an uninterrupted one would."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train

pytestmark = pytest.mark.reliability


def kill_a_generation_after_step_one(metrics: Path, stop: threading.Event, killed: list[int]) -> None:
    """Once step 1 is logged (the rollout then serves updated weights), SIGKILL the rollout worker
    while it executes ``generate`` (Ray titles the process ``ray::HFRolloutWorker.generate``)."""
    while not stop.is_set() and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.005)
    while not stop.is_set() and not killed:
        for proc in Path("/proc").iterdir():
            try:
                title = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::HFRolloutWorker.generate"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
                return
        time.sleep(0.005)


@pytest.mark.slow
def test_a_killed_rollout_worker_is_restarted_and_the_step_completes(prefect_api, ray_local, tiny_overrides, tmp_path):
    words = [w for w in tiny_overrides if not w.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=3",
        "data.max_response_length=40",
        f"trainer.default_local_dir={tmp_path}/run",
        "actor_rollout_ref.hybrid_engine=false",
    ]  # a rollout worker of its own, which Ray restarts
    stop, killed = threading.Event(), []
    killer = threading.Thread(
        target=kill_a_generation_after_step_one, args=(tmp_path / "run" / "metrics.jsonl", stop, killed), daemon=True
    )
    killer.start()
    try:
        state = ppo_train(config="grpo_tiny", overrides=words, return_state=True)
    finally:
        stop.set()
        killer.join(timeout=5)
    assert killed, "no generation was caught in progress"
    assert state.is_completed(), state
    rows = read_metrics(f"{tmp_path}/run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    # the restarted worker came back with its initial weights: the flow noticed, re-synced, regenerated
    assert sum(row.get("training/rollout_regenerated", 0) for row in rows) == 1
    assert all(row["training/off_policy/trajectory_staleness/max"] == 0 for row in rows)


KILLING_SCORER = """
import os, signal, time
from pathlib import Path
from ppoflow.algorithms.scoring import copy_score

calls = 0

def kill_the_generation():
    # Ray titles the worker process ``ray::HFRolloutWorker.generate`` only once the call has started
    # executing, which may be a moment after it was submitted: wait for that title, then SIGKILL.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                title = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::HFRolloutWorker.generate"):
                os.kill(int(proc.name), signal.SIGKILL)
                return title.decode(errors="replace")
        time.sleep(0.005)
    return "no generation was seen in progress"

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # The first response scored in step 2 (16 responses a step): one_step_off has just submitted step 3's
    # generation in the background; kill the rollout worker in the middle of it.
    global calls
    calls += 1
    if calls == 17:
        Path(os.environ["PPOFLOW_TEST_KILLED"]).write_text(kill_the_generation())
    return copy_score(data_source, solution_str, ground_truth, extra_info)
"""

UPDATE_METRICS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")


@pytest.mark.slow
def test_one_step_off_regenerates_a_lost_batch_with_the_weights_it_was_started_with(
    prefect_api, ray_local, tiny_overrides, tmp_path, monkeypatch
):
    """Step 3's batch is started (with the weights before step 2's update) while step 2 trains; the rollout
    worker dies meanwhile. The batch is generated again with those same weights, which the actor kept,
    so every step matches an uninterrupted run."""
    (tmp_path / "killing_scorer.py").write_text(KILLING_SCORER)
    monkeypatch.setenv("PPOFLOW_TEST_KILLED", str(tmp_path / "killed.txt"))
    words = [w for w in tiny_overrides if not w.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=3",
        "data.max_response_length=48",
        "trainer.mode=one_step_off",
    ]
    killed = ppo_train(
        config="grpo_tiny",
        return_state=True,
        overrides=words
        + [f"custom_reward_function.path={tmp_path}/killing_scorer.py", f"trainer.default_local_dir={tmp_path}/killed"],
    )
    assert killed.is_completed(), killed
    assert "generate" in (tmp_path / "killed.txt").read_text()  # it died in the middle of a generation
    rows = read_metrics(f"{tmp_path}/killed")
    assert [row.get("training/rollout_regenerated", 0) for row in rows] == [0, 0, 1]
    assert [row["training/off_policy/trajectory_staleness/max"] for row in rows] == [0, 1, 1]  # still one step off
    straight = ppo_train(
        config="grpo_tiny",
        return_state=True,
        overrides=words + ["custom_reward_function.path=null", f"trainer.default_local_dir={tmp_path}/straight"],
    )
    assert straight.is_completed(), straight
    for before, after in zip(read_metrics(f"{tmp_path}/straight"), rows):
        for name in UPDATE_METRICS:
            assert before[name] == after[name], (before["step"], name)
