"""Prefect artifacts of a training run: what the UI shows about a run without opening its run directory.

Keys derive from ``trainer.project_name`` and ``trainer.experiment_name``, so every run of one experiment
adds a version to the same three artifacts:

* ``<slug>-progress``: percent of the steps done, updated in place after each step;
* ``<slug>-metrics``: a table with one row per step and a readable subset of the metrics;
* ``<slug>-summary``: markdown with the final metrics, where the run directory, checkpoint and caches
  live, the reward curve, and the whole config.

The reward curve is also written as ``reward_curve.png`` to the run directory (any fsspec URL), since it
is useful without Prefect. Outside a flow run (the bare benchmark baseline) nothing is published.
"""

from __future__ import annotations

import base64
import io
import math
import re

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)
from prefect.context import FlowRunContext, TaskRunContext

from ppoflow.configs import config_as_dict
from ppoflow.configs.schema import PPOConfig
from ppoflow.storage.fs import atomic_write, join, open_fs

TABLE_COLUMNS = {"critic/score/mean": "score", "critic/rewards/mean": "rewards", "actor/pg_loss": "pg_loss",
                 "actor/grad_norm": "grad_norm", "actor/entropy": "entropy",
                 "response_length/mean": "response_length", "timing_s/step": "step_s"}
"""The metrics the per-step table shows (verl name -> column), besides ``step`` and ``val-core/*``."""

SCORE = "critic/score/mean"
VALIDATION = re.compile(r"^val-core/.+/reward/mean@\d+$")


def artifact_slug(cfg: PPOConfig) -> str:
    """``project-experiment`` as an artifact key prefix: lowercase letters, digits and dashes."""
    name = f"{cfg.trainer.project_name}-{cfg.trainer.experiment_name}".lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


class RunArtifacts:
    """Prefect artifacts of one training run; a no-op outside a Prefect flow run (bare benchmark runs)."""

    def __init__(self, cfg: PPOConfig, total_steps: int, *, first_step: int = 1):
        self.cfg = cfg
        self.total_steps = total_steps
        self.slug = artifact_slug(cfg)
        self.active = FlowRunContext.get() is not None or TaskRunContext.get() is not None
        self.progress_id = None
        if self.active:
            self.progress_id = create_progress_artifact(
                progress=100.0 * (first_step - 1) / total_steps, key=f"{self.slug}-progress",
                description=f"{cfg.trainer.experiment_name}: training steps done")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        """Record that ``step`` is done (``metrics`` are that step's; only the progress is published)."""
        if self.active:
            update_progress_artifact(artifact_id=self.progress_id, progress=100.0 * step / self.total_steps)

    def finish(self, rows: list[dict], *, checkpoint: str | None, caches: list[str]) -> str:
        """Write the reward curve to the run directory and publish the metrics table and the summary;
        ``rows`` are the run's per-step metrics (each with ``step``). Returns the PNG's location."""
        figure = reward_figure(rows, self.cfg.trainer.experiment_name)
        png_url = join(self.cfg.trainer.default_local_dir, "reward_curve.png")
        fs, path = open_fs(png_url)
        atomic_write(fs, path, png_bytes(figure, dpi=100))
        if self.active:
            create_table_artifact(table=metrics_table(rows), key=f"{self.slug}-metrics",
                                  description=f"{self.cfg.trainer.experiment_name}: metrics per step")
            thumbnail = base64.b64encode(png_bytes(figure, dpi=50)).decode()
            create_markdown_artifact(markdown=self.summary(rows, checkpoint, caches, png_url, thumbnail),
                                     key=f"{self.slug}-summary",
                                     description=f"{self.cfg.trainer.experiment_name}: run summary")
        return png_url

    def summary(self, rows: list[dict], checkpoint: str | None, caches: list[str], png_url: str,
                thumbnail: str) -> str:
        """The summary artifact's markdown."""
        trainer = self.cfg.trainer
        last = rows[-1] if rows else {}
        config = yaml.safe_dump(config_as_dict(self.cfg), sort_keys=False)
        return "\n".join([
            f"# {trainer.experiment_name} ({trainer.project_name})",
            "",
            f"* algorithm: `{self.cfg.algorithm.adv_estimator}`, {'with' if self.cfg.use_critic else 'no'} critic,"
            f" mode `{trainer.mode}`",
            f"* steps: {last.get('step', 0)} of {self.total_steps}",
            f"* run directory: `{trainer.default_local_dir}`",
            f"* checkpoint: {f'`{checkpoint}`' if checkpoint else 'none'}",
            f"* caches: {', '.join(f'`{cache}`' for cache in caches) or 'none'}",
            "",
            f"## Final metrics (step {last.get('step', '-')})",
            "",
            markdown_table({name: value for name, value in (metrics_table([last])[0] if last else {}).items()
                            if value != ""}),
            "",
            "<details><summary>all metrics of the last step</summary>",
            "",
            markdown_table({name: _cell(value) for name, value in sorted(last.items())}),
            "",
            "</details>",
            "",
            "## Reward curve",
            "",
            f"![reward curve](data:image/png;base64,{thumbnail})",
            "",
            f"Full size: `{png_url}`",
            "",
            "## Config",
            "",
            "<details><summary>config (YAML)</summary>",
            "",
            "```yaml",
            config.rstrip(),
            "```",
            "",
            "</details>",
        ])


def metrics_table(rows: list[dict]) -> list[dict]:
    """One table row per step: ``step``, :data:`TABLE_COLUMNS` and every ``val-core/*`` metric present
    (as ``val/...``); missing values are ``""``."""
    validation = sorted({name for row in rows for name in row if name.startswith("val-core/")})
    columns = {"step": "step", **TABLE_COLUMNS, **{name: "val/" + name.removeprefix("val-core/") for name in validation}}
    return [{label: _cell(row.get(name)) for name, label in columns.items()} for row in rows]


def markdown_table(row: dict) -> str:
    """A ``| metric | value |`` markdown table of one row."""
    lines = ["| metric | value |", "| --- | --- |"]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in row.items()])


def reward_figure(rows: list[dict], title: str) -> Figure:
    """Training score per step, and validation rewards as markers, on an Agg canvas (no display needed)."""
    figure = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    scored = [row for row in rows if _finite(row.get(SCORE))]
    axes.plot([row["step"] for row in scored], [row[SCORE] for row in scored], label="train score")
    for name in sorted({name for row in rows for name in row if VALIDATION.match(name)}):
        points = [row for row in rows if _finite(row.get(name))]
        axes.plot([row["step"] for row in points], [row[name] for row in points], "o--",
                  label="val " + name.removeprefix("val-core/"))
    axes.set(xlabel="step", ylabel="reward", title=title)
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    return figure


def png_bytes(figure: Figure, *, dpi: int) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _cell(value) -> str | int | float:
    """A table cell: ``""`` for a missing value, numbers to 4 significant digits, ints as they are."""
    if value is None:
        return ""
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else str(value)
    return value


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
