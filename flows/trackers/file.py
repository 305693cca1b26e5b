"""``trainer.logger=file``: verl's file logger, one ``{"step": N, "data": {metric: value}}`` line per step in
``$VERL_FILE_LOGGER_PATH``, else ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root ``.``). A
resumed run keeps the lines of the steps before it and appends."""

from __future__ import annotations

import json
import os

from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.trackers import Backend
from ppoflow.flows.tracking import json_number


def file_logger_path(cfg: PPOConfig) -> str:
    """Where verl's file logger writes for ``cfg``."""
    path = os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return path
    root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
    return os.path.join(root, cfg.trainer.project_name, f"{cfg.trainer.experiment_name}.jsonl")


class FileBackend(Backend):
    name = "file"

    def start(self, cfg: PPOConfig, *, resume_id: str | None, first_step: int) -> str | None:
        self.path = file_logger_path(cfg)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        kept = []
        if first_step > 1 and os.path.exists(self.path):
            with open(self.path, "rb") as handle:
                kept = [line for line in handle if _step(line) is not None and _step(line) < first_step]
        self.handle = open(self.path, "wb", buffering=0)  # noqa: SIM115 - open for the run's length
        self.handle.write(b"".join(kept))
        return None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.handle.write(
            json.dumps({"step": step, "data": {k: json_number(v) for k, v in metrics.items()}}).encode() + b"\n"
        )

    def link(self) -> str | None:
        return self.path

    def finish(self) -> None:
        self.handle.close()


def _step(line: bytes) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:  # a torn line
        return None
    return row.get("step") if isinstance(row, dict) and type(row.get("step")) is int else None


BACKEND = FileBackend
