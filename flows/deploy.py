"""The Prefect deployments, as code: ``ppo-train`` (start a training run from the UI's form) and
``regression-replay`` (replay golden cached rollouts through the current trainer on a cron schedule).

``ppoflow serve`` registers both and runs them from this process (no work pool needed), by the
installed package's module paths (``ppoflow.flows.train.ppo_train``), so where it is started from does
not matter; the ``prefect.yaml`` at the repository root declares the same two deployments for
``prefect deploy`` onto a work pool.
"""

from __future__ import annotations

from prefect import serve
from prefect.deployments.runner import EntrypointType, RunnerDeployment

from ppoflow.flows.replay import regression_replay
from ppoflow.flows.train import ppo_train

NIGHTLY = "0 3 * * *"


def deployments(replay_dir: str, cron: str = NIGHTLY) -> list[RunnerDeployment]:
    """The two deployments; ``replay_dir`` is the golden directory ``ppoflow replay record`` wrote."""
    return [
        ppo_train.to_deployment(name="ppo-train", tags=["ppoflow"], entrypoint_type=EntrypointType.MODULE_PATH,
                                description="Train with PPO/GRPO: a preset or YAML, key=value overrides, and the "
                                            "common knobs as typed fields."),
        regression_replay.to_deployment(name="regression-replay", tags=["ppoflow", "regression"], cron=cron,
                                        entrypoint_type=EntrypointType.MODULE_PATH,
                                        parameters={"directory": replay_dir},
                                        description="Replay the golden cached rollouts through the current trainer "
                                                    "and fail, with a diff table, when a metric moves."),
    ]


def serve_deployments(replay_dir: str, cron: str = NIGHTLY, limit: int = 1) -> None:
    """Register the deployments and execute their runs (manual or scheduled) until interrupted."""
    serve(*deployments(replay_dir, cron), limit=limit)
