"""``trainer.logger=trackio``: a trackio run (HF's local-first tracker, files under ``TRACKIO_DIR``) named
``trainer.experiment_name`` in project ``trainer.project_name``; a resumed run resumes it by name."""

from __future__ import annotations

from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.trackers import Backend


class TrackioBackend(Backend):
    name = "trackio"

    def start(self, cfg: PPOConfig, *, resume_id: str | None, first_step: int) -> str | None:
        import trackio

        from ppoflow.configs import config_as_dict

        self.run = trackio.init(
            project=cfg.trainer.project_name,
            name=resume_id or cfg.trainer.experiment_name,
            config=config_as_dict(cfg),
            resume="allow" if resume_id else "never",
            embed=False,
        )
        return self.run.name

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def link(self) -> str | None:
        return f"trackio project {self.run.project}, run {self.run.name}"

    def finish(self) -> None:
        self.run.finish()


BACKEND = TrackioBackend
