"""The Prefect deployments, as code: ``ppo-train`` (start a training run from the UI's form) and
``regression-replay`` (replay golden cached rollouts through the current trainer on a cron schedule).

``ppoflow serve`` registers both and runs them from this process (no work pool needed), by the
installed package's module paths (``ppoflow.flows.train.ppo_train``), so where it is started from does
not matter; the ``prefect.yaml`` at the repository root declares the same two deployments for
``prefect deploy`` onto a work pool. A ``replay_dir`` that holds no golden baseline registers the nightly
schedule inactive, with a warning: it could only fail every night.
"""

from __future__ import annotations

import sys

from prefect import serve
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.schedules import Cron

from ppoflow.configs import load_config
from ppoflow.flows.replay import regression_replay
from ppoflow.flows.replay.baseline import BASELINE_FILE
from ppoflow.flows.train import check_mode, ppo_train, typed_fields
from ppoflow.storage.fs import open_fs

NIGHTLY = "0 3 * * *"
DEFAULT_PRESET = "grpo_tiny"


def form_defaults(preset: str = DEFAULT_PRESET) -> dict:
    """The ``ppo-train`` deployment's parameters: the preset and the values its typed fields take in it.

    Prefect's run form starts from a deployment's parameters (never from the flow's signature), so
    these are what makes the form show the values a run will use instead of blank fields. The preset's
    ``trainer.v1.trainer_module`` is imported first (:func:`check_mode`), so its modes are registered: the form
    offers them, and one the preset names fills the ``mode`` field."""
    cfg = load_config(preset)
    check_mode(cfg)
    return {"config": preset, **typed_fields(cfg)}


def holds_baseline(replay_dir: str) -> bool:
    """Whether ``replay_dir`` holds the ``baseline.json`` of ``ppoflow replay record``."""
    fs, root = open_fs(replay_dir)
    return fs.exists(f"{root}/{BASELINE_FILE}")


def deployments(replay_dir: str, cron: str = NIGHTLY, preset: str = DEFAULT_PRESET) -> list[RunnerDeployment]:
    """The two deployments; ``replay_dir`` is the golden directory ``ppoflow replay record`` wrote,
    ``preset`` the config ``ppo-train``'s form starts from. Without a baseline there, the replay's schedule is
    registered inactive (activate it in the UI once one is recorded) and a warning says so."""
    form = form_defaults(preset)  # a config that does not load fails first
    scheduled = holds_baseline(replay_dir)
    if not scheduled:
        print(
            f"ppoflow: warning: --replay-dir {replay_dir} holds no {BASELINE_FILE} (record one with `ppoflow replay "
            f"record --dir {replay_dir}`); the regression-replay schedule ({cron}) is registered inactive",
            file=sys.stderr,
        )
    return [
        ppo_train.to_deployment(
            name="ppo-train",
            tags=["ppoflow"],
            entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=form,
            description=f"Train with PPO/GRPO: a preset or YAML, key=value overrides, and the "
            f"common knobs as typed fields, filled in with {preset}'s values "
            f"(they are applied over any config you choose; clear one to keep "
            f"that config's).",
        ),
        regression_replay.to_deployment(
            name="regression-replay",
            tags=["ppoflow", "regression"],
            schedules=[Cron(cron, active=scheduled)],
            entrypoint_type=EntrypointType.MODULE_PATH,
            parameters={"directory": replay_dir},
            description="Replay the golden cached rollouts through the current trainer "
            "and fail, with a diff table, when a metric moves.",
        ),
    ]


def serve_deployments(replay_dir: str, cron: str = NIGHTLY, limit: int = 1, preset: str = DEFAULT_PRESET) -> None:
    """Register the deployments and execute their runs (manual or scheduled) until interrupted."""
    serve(*deployments(replay_dir, cron, preset), limit=limit)
