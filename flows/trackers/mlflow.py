"""``trainer.logger=mlflow``: an MLflow run named ``trainer.experiment_name`` in the experiment
``trainer.project_name`` (verl's mapping), at ``trainer.mlflow_tracking_uri``, else ``MLFLOW_TRACKING_URI``,
else verl's ``sqlite:////tmp/mlruns.db``. The config is its params (``section/key``), the reward curve and each
validation's samples (``val_step<N>.json``) its artifacts. A resumed run reopens the checkpoint's run id and
skips the steps the run already has (metric keys sanitized as verl does)."""

from __future__ import annotations

import json
import os
import re
import tempfile
import time

from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.trackers import Backend, config_params

DEFAULT_URI = "sqlite:////tmp/mlruns.db"
EVERY_STEP = "training/nonfinite_skipped"
"""A metric every step logs: its history tells a resumed run which steps the MLflow run has."""
BATCH = 100
"""MLflow takes at most this many params (and 1000 metrics) per request."""
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's request settings unless set (its own: 7 retries with backoff, 120 s each)."""


def tracking_uri(cfg: PPOConfig) -> str:
    return cfg.trainer.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def sanitize(key: str) -> str:
    """A metric name MLflow accepts: ``@`` as ``_at_``, single slashes, other odd characters as ``_``."""
    return re.sub(r"[^/\w.\- :]", "_", re.sub(r"/+", "/", key.replace("@", "_at_")))


class MlflowBackend(Backend):
    name = "mlflow"

    def start(self, cfg: PPOConfig, *, resume_id: str | None, first_step: int) -> str | None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        for name, value in HTTP_DEFAULTS.items():  # a tracker that is down must not stall the run for minutes
            os.environ.setdefault(name, value)
        self.uri = tracking_uri(cfg)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.logged_up_to = 0
        if resume_id:
            run = self.client.get_run(resume_id)
            self.client.update_run(resume_id, status="RUNNING")
            history = self.client.get_metric_history(resume_id, EVERY_STEP)
            self.logged_up_to = max((metric.step for metric in history), default=0)
        else:
            experiment = self.client.get_experiment_by_name(cfg.trainer.project_name)
            experiment_id = (
                experiment.experiment_id if experiment else self.client.create_experiment(cfg.trainer.project_name)
            )
            run = self.client.create_run(experiment_id, run_name=cfg.trainer.experiment_name)
            params = [Param(key, str(value)[:6000]) for key, value in config_params(cfg).items()]
            for start in range(0, len(params), BATCH):
                self.client.log_batch(run.info.run_id, params=params[start : start + BATCH])
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        return self.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_up_to:  # logged before the crash this run resumed from
            return
        now = int(time.time() * 1000)
        batch = [Metric(sanitize(key), float(value), now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_table(self, step: int, samples: list[dict]) -> None:
        self.client.log_text(self.run_id, json.dumps(samples, ensure_ascii=False), f"val_step{step}.json")

    def log_file(self, name: str, data: bytes) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, name)
            with open(path, "wb") as handle:
                handle.write(data)
            self.client.log_artifact(self.run_id, path)

    def link(self) -> str | None:
        if self.uri.startswith(("http://", "https://")):
            return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return f"MLflow run {self.run_id} in {self.uri}"

    def finish(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")


BACKEND = MlflowBackend
