"""Helpers of the end-to-end tests that train tiny runs with the step cache: run a flow and read what it
left (metrics, Prefect's task runs, cache entries). The session's golden run is ``golden`` in conftest."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from tests.conftest import small_run

PROJECT = "grpo_tiny_ppoflow"
CONFIG = "GBS4_N4_in8_out3"
UPDATE_METRICS = (
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
)


def train(
    overrides: list[str], run_dir: Path, steps: int, skip: dict[str, str], *, validations: int = 0
) -> tuple[list[dict], list]:
    """Run the flow (without validation unless ``validations`` are expected); return its metrics rows
    and the final states of its generate task runs."""
    rows, states, _ = train_run(overrides, run_dir, steps, skip, validations=validations)
    return rows, states


def train_run(
    overrides: list[str], run_dir: Path, steps: int, skip: dict[str, str], *, validations: int = 0
) -> tuple[list[dict], list, str]:
    """:func:`train`, and the flow run's id."""
    words = (
        overrides
        + ([] if validations else ["trainer.test_freq=-1"])
        + [f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}"]
        + [f"skip.{key}={value}" for key, value in skip.items()]
    )
    state = ppo_train(config="grpo_tiny", overrides=words, return_state=True)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    return read_metrics(str(run_dir)), generate_states(flow_run_id, steps + validations), flow_run_id


def generate_states(flow_run_id, expected: int) -> list[str]:
    """Names of the final states of the flow run's ``generate`` task runs, in start order."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="generate")),
                sort=TaskRunSort.EXPECTED_START_TIME_ASC,
            )
            if (
                len(runs) >= expected and all(run.state and run.state.is_final() for run in runs)
            ) or time.monotonic() > deadline:
                return [run.state.name for run in runs]
            time.sleep(0.5)


def task_runs_by_name(flow_run_id, names: list[str]) -> dict:
    """The flow run's task runs by name, once the server has recorded each of ``names`` in a final state
    (task states reach it as events, which its task-run recorder writes in batches)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = {
                run.name: run
                for run in client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200
                )
            }
            if all(name in runs and runs[name].state and runs[name].state.is_final() for name in names):
                return runs
            assert time.monotonic() < deadline, f"task runs {names} not all recorded: {sorted(runs)}"
            time.sleep(0.5)


def rollout_skip(dump_dir, steps, action="cache") -> dict[str, str]:
    return {
        "rollout.enable": "true",
        "rollout.dump_dir": str(dump_dir),
        "rollout.steps": str(steps),
        "rollout.action": action,
    }


def cached_steps(dump_dir: Path) -> list[int]:
    root = dump_dir / PROJECT / CONFIG
    return sorted(int(p.name) for p in root.iterdir() if (p / "meta.json").exists()) if root.exists() else []


def small(root, tiny_model) -> list[str]:
    """The shared tiny run without validation or a run directory (each run names its own)."""
    return [word for word in small_run(tiny_model, root) if not word.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
    ]


def copy_dump(golden, tmp_path) -> Path:
    shutil.copytree(golden.dump, tmp_path / "dump")
    return tmp_path / "dump"
