"""A rollout worker killed in the middle of a generation is restarted and the step completes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train


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


def test_a_killed_rollout_worker_is_restarted_and_the_step_completes(prefect_api, ray_local, tiny_overrides, tmp_path):
    words = [w for w in tiny_overrides if not w.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null", "trainer.logger=[]", "trainer.test_freq=-1", "trainer.total_training_steps=3",
        "data.max_response_length=40", "actor_rollout_ref.model.build=null", f"trainer.default_local_dir={tmp_path}/run"]
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=kill_a_generation_after_step_one,
                              args=(tmp_path / "run" / "metrics.jsonl", stop, killed), daemon=True)
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
