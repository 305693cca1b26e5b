"""``trainer.logger=wandb``: a wandb run named ``trainer.experiment_name`` in project ``trainer.project_name``
with the config, online or offline (``WANDB_MODE=offline``). Its files go to the run directory's ``wandb/``
(when local and ``WANDB_DIR`` is unset). A resumed run passes the checkpoint's run id with ``resume="allow"``;
wandb drops the steps it already has. Validation samples go to the ``val/generations`` table."""

from __future__ import annotations

import os

from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.trackers import Backend

COLUMNS = ["step", "input", "output", "score"]


class WandbBackend(Backend):
    name = "wandb"

    def start(self, cfg: PPOConfig, *, resume_id: str | None, first_step: int) -> str | None:
        import wandb

        from ppoflow.configs import config_as_dict
        from ppoflow.storage.fs import normalize_url

        run_dir = normalize_url(cfg.trainer.default_local_dir)
        directory = None if "WANDB_DIR" in os.environ or "://" in run_dir else run_dir
        if directory:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(
            project=cfg.trainer.project_name,
            name=cfg.trainer.experiment_name,
            entity=os.environ.get("WANDB_ENTITY"),
            config=config_as_dict(cfg),
            id=resume_id,
            resume="allow" if resume_id else None,
            dir=directory,
            reinit="create_new",
        )
        self.rows: list[list] = []
        return self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, samples: list[dict]) -> None:
        import wandb

        self.rows += [[step, *(sample[column] for column in COLUMNS[1:])] for sample in samples]
        self.run.log({"val/generations": wandb.Table(columns=COLUMNS, data=list(self.rows))}, step=step)

    def link(self) -> str | None:
        return self.run.url or f"wandb run {self.run.id} (offline: {self.run.dir})"

    def finish(self) -> None:
        self.run.finish()


BACKEND = WandbBackend
