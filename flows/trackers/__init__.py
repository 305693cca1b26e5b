"""The experiment trackers ``trainer.logger`` names besides ``console`` and ``tensorboard`` (which
:mod:`ppoflow.flows.tracking` writes itself): ``wandb``, ``mlflow``, ``file`` (verl's JSONL file logger) and
``trackio``, one module each behind :class:`Backend`. Project and run names follow verl's ``Tracking``:
``trainer.project_name`` is the wandb/trackio project and the MLflow experiment, ``trainer.experiment_name``
the run's name. A resumed run continues the tracker run whose id its checkpoint keeps. Details: docs/trackers.md.
"""

from __future__ import annotations

from importlib import import_module

from ppoflow.configs.schema import PPOConfig

BACKENDS = {"wandb": "wandb", "mlflow": "mlflow", "file": "file", "trackio": "trackio"}
"""``trainer.logger`` name -> module of this package holding its :class:`Backend` (as ``BACKEND``)."""


class Backend:
    """One tracker: started once per run, then fed each step's metrics; the no-op defaults are for what a
    tracker has no place for."""

    name = ""

    def start(self, cfg: PPOConfig, *, resume_id: str | None, first_step: int) -> str | None:
        """Open the tracker run (the one ``resume_id`` names, when given); return the id a checkpoint keeps."""
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def log_table(self, step: int, samples: list[dict]) -> None:
        """Validation samples (``input``, ``output``, ``score``; ``trainer.log_val_generations`` of them)."""

    def log_file(self, name: str, data: bytes) -> None:
        """A file of the run (the reward curve) as an artifact of the tracker run."""

    def link(self) -> str | None:
        """Where to see the run (a URL, or the run's id and store), for the summary artifact."""
        return None

    def finish(self) -> None:
        raise NotImplementedError


def backend(name: str) -> Backend:
    """A fresh :class:`Backend` for a ``trainer.logger`` name of :data:`BACKENDS`."""
    return import_module(f"{__name__}.{BACKENDS[name]}").BACKEND()


def config_params(cfg: PPOConfig) -> dict[str, object]:
    """The config flattened to ``section/key`` names (verl's MLflow params), lists as their text."""
    from ppoflow.configs import config_as_dict

    flat: dict[str, object] = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}/")
            else:
                flat[f"{prefix}{key}"] = value

    walk(config_as_dict(cfg), "")
    return flat
