"""The kill/resume sweep: ``ppoflow train`` SIGKILLed at many moments (between steps, in the middle of a
generation, of an update, of a checkpoint, of one_step_off's in-flight batch, twice in a row), in both
modes, then started again: every run resumes from its newest complete checkpoint and ends with every
step's metrics identical to an uninterrupted run's; and colocate_async killed at three of those moments,
which must train every prompt it fed once (its batches depend on timing, so its metrics cannot match).

Slow (a few minutes): left out of the default run, run by ``scripts/reliability.sh``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ppoflow.flows.train import ppo_train
from tests.preflight_helpers import DEMO_TRAIN
from tests.test_resume import SLOW_SCORER, assert_same_steps, rows_by_step

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

STEPS = 4


def running(title: bytes) -> bool:
    """Whether a process whose title starts with the pattern ``title`` exists (Ray titles a worker
    ``ray::<class>.<method it executes>``)."""
    for proc in Path("/proc").iterdir():
        try:
            if re.match(title, (proc / "cmdline").read_bytes()):
                return True
        except OSError:
            continue
    return False


def after_step(step: int) -> Callable[[Path], bool]:
    return lambda run: (
        (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= step
    )


def after_step_while(step: int, title: bytes) -> Callable[[Path], bool]:
    return lambda run: after_step(step)(run) and running(title)


def mid_checkpoint(written: str) -> Callable[[Path], bool]:
    """Some checkpoint's ``written`` file (a glob) exists and its marker does not yet."""

    def moment(run: Path) -> bool:
        return any(
            not (found.parent.parent if "/" in written else found.parent).joinpath("checkpoint.json").exists()
            for found in run.glob(f"global_step_*/{written}")
        )

    return moment


MOMENTS = {
    "between steps": after_step(1),
    "mid generation": after_step_while(1, rb"ray::\w+\.generate"),  # the rollout's, or the colocated actor's
    "mid update": after_step_while(1, rb"ray::\w*ActorWorker\.update"),
    "mid checkpoint weights": mid_checkpoint("actor/model.safetensors"),
    "mid checkpoint state": mid_checkpoint("trainer_state.json"),
    "mid in-flight batch": mid_checkpoint("mode.in_flight.*.safetensors"),
}
CASES = [
    (mode, moment)
    for mode in ("sync", "one_step_off")
    for moment in MOMENTS
    if mode == "one_step_off" or moment != "mid in-flight batch"
]


@pytest.fixture(scope="module")
def straight(prefect_server, ray_local, tiny_model, tmp_path_factory):
    """One uninterrupted run per mode, the reference of every case."""
    from tests.conftest import prefect_settings, small_run

    root = tmp_path_factory.mktemp("straight")
    (root / "slow_scorer.py").write_text(SLOW_SCORER)
    words = [w for w in small_run(tiny_model, root) if not w.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=1",
        f"custom_reward_function.path={root}/slow_scorer.py",
    ]
    rows = {}
    with prefect_settings(prefect_server):
        for mode in ("sync", "one_step_off"):
            ppo_train(
                config="grpo_tiny",
                overrides=words + [f"trainer.mode={mode}", f"trainer.default_local_dir={root}/{mode}"],
            )
            rows[mode] = rows_by_step(root / mode)
    return words, rows


def kill_at(moment: Callable[[Path], bool], words: list[str], run: Path, env: dict) -> bool:
    """Start ``ppoflow train`` and SIGKILL it at ``moment``; whether the moment came before the run ended."""
    process = subprocess.Popen(
        [
            *DEMO_TRAIN,
            *words,
            f"trainer.default_local_dir={run}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while process.poll() is None and time.monotonic() < deadline:
            if moment(run):
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=30)
                return True
            time.sleep(0.002)
        return False
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.parametrize("mode, moment", CASES)
def test_killed_at_any_moment_resumes_to_the_same_run(prefect_api, ray_local, straight, tmp_path, mode, moment):
    words, reference = straight
    words = words + [f"trainer.mode={mode}"]
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    run = tmp_path / "run"
    assert kill_at(MOMENTS[moment], words, run, env), f"the run ended before the moment {moment!r}"
    if moment == "mid update":  # and once more, while the restarted run generates
        assert kill_at(MOMENTS["mid generation"], words, run, env), "the second kill came too late"
    state = ppo_train(config="grpo_tiny", overrides=words + [f"trainer.default_local_dir={run}"], return_state=True)
    assert state.is_completed(), state
    resumed = rows_by_step(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert_same_steps(reference[mode], resumed, range(1, STEPS + 1))


ASYNC_MOMENTS = ("between steps", "mid update", "mid checkpoint state")


@pytest.mark.parametrize("moment", ASYNC_MOMENTS)
def test_a_killed_async_run_trains_every_prompt_once(prefect_api, ray_local, tiny_model, tmp_path, moment):
    """colocate_async killed at ``moment`` and resumed: of the steps that count (a step trained again after
    the kill replaces the killed run's), no prompt is trained twice, and every prompt fed is trained or
    still in the buffer at the end. The ledger mode writes down what each step trains."""
    from tests.async_modes_helpers import LEDGER_MODE
    from tests.conftest import small_run

    log = tmp_path / "ledger.jsonl"
    name = f"ledger_async_{ASYNC_MOMENTS.index(moment)}"  # a mode name per file: one process runs every case
    (tmp_path / "ledger.py").write_text(LEDGER_MODE.format(log=str(log), name=name))
    words = [w for w in small_run(tiny_model, tmp_path) if not w.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=1",
        "actor_rollout_ref.rollout.mode=async",
        f"trainer.v1.trainer_module={tmp_path}/ledger.py",
        f"trainer.v1.trainer_mode={name}",
    ]
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    run = tmp_path / "run"
    assert kill_at(MOMENTS[moment], words, run, env), f"the run ended before the moment {moment!r}"
    state = ppo_train(config="grpo_tiny", overrides=words + [f"trainer.default_local_dir={run}"], return_state=True)
    assert state.is_completed(), state
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    counted = {entry["step"]: entry["trained"] for entry in entries if "trained" in entry}  # the last one per step
    assert sorted(counted) == list(range(1, STEPS + 1))
    uids = [uid for step in sorted(counted) for uid in counted[step]]
    assert len(uids) == len(set(uids)) == STEPS * 4
    (end,) = [entry for entry in entries if "left" in entry]
    assert set(uids).isdisjoint(end["left"])
    assert set(uids) | set(end["left"]) == {f"sample_0_{index}" for index in range(1, end["fed"] + 1)}
    assert sorted(rows_by_step(run)) == list(range(1, STEPS + 1))
