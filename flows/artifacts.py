"""Prefect artifacts of a training run: what the UI shows about a run without opening its run directory.

Keys are unique per run - ``<slug>-<flow run name>-<what>``, the slug from ``trainer.project_name`` and
``trainer.experiment_name`` - for ``-progress`` (updated at most once a second, :data:`PROGRESS_INTERVAL_S`, and
after the last step), ``-metrics`` (a row per step), ``-summary``, ``-config`` and ``-staleness`` (only when some
sample was off-policy); ``<slug>-latest`` gets a version per run naming that run's keys. The reward curve is also
written as ``reward_curve.png`` to the run directory (any fsspec URL). Outside a flow run nothing is published.
Details: docs/ui.md, docs/deployments.md#artifacts.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import re
import time
from typing import TYPE_CHECKING

import torch
import yaml
from prefect.artifacts import (
    TableArtifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext
from tensordict import TensorDict

from ppoflow.algorithms.validation_metrics import CORE_MEAN
from ppoflow.configs import config_as_dict
from ppoflow.configs.schema import PPOConfig
from ppoflow.storage.fs import atomic_write, join, open_fs

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

TABLE_COLUMNS = {
    "critic/score/mean": "score",
    "critic/rewards/mean": "rewards",
    "actor/pg_loss": "pg_loss",
    "actor/grad_norm": "grad_norm",
    "actor/entropy": "entropy",
    "response_length/mean": "response_length",
    "training/off_policy/trajectory_staleness/mean": "staleness",
    "training/off_policy/trajectory_staleness/max": "staleness_max",
    "agent/num_turns/mean": "turns",
    "agent/tool_calls/mean": "tool_calls",
    "agent/tool_errors/count": "tool_errors",
    "timing_s/step": "step_s",
}
"""The metrics the per-step table shows (verl name -> column), besides ``step``, the per-stage timings and
``val-core/*``; a column no row has a value for is left out (a single-turn run has no agent columns)."""

TIMING = "timing_s/"
"""verl's prefix of the per-stage timings (``timing_s/gen``, ``timing_s/update_actor``, ...): each is a table
column ``<stage>_s`` with 3 significant digits - the UI rounds a task run's duration to whole seconds."""

PROGRESS_INTERVAL_S = 1.0
"""The least time between two updates of the progress artifact. Each update is a request to the Prefect
server that the flow's thread waits for, longer than a small step's stage (docs/benchmarks.md, "What a
task run costs"); a progress bar gains nothing from more than one a second.
"""

SCORE = "critic/score/mean"


def artifact_slug(cfg: PPOConfig) -> str:
    """``project-experiment`` as an artifact key prefix: lowercase letters, digits and dashes."""
    return _key_part(f"{cfg.trainer.project_name}-{cfg.trainer.experiment_name}")


def _key_part(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class RunArtifacts:
    """Prefect artifacts of one training run; a no-op outside a Prefect flow run (bare benchmark runs)."""

    def __init__(self, cfg: PPOConfig, total_steps: int, *, first_step: int = 1):
        self.cfg = cfg
        self.total_steps = total_steps
        self.slug = artifact_slug(cfg)
        context = FlowRunContext.get()
        self.active = context is not None and context.flow_run is not None
        self.run_name = context.flow_run.name if self.active else ""
        self.prefix = f"{self.slug}-{_key_part(self.run_name)}"
        self.validation_before_training: dict[str, float] = {}
        self.staleness: dict[int, int] = {}
        """Trained samples by staleness: how many weight updates older than the newest their newest token is."""
        self.progress_id = None
        self.progress_shown_at = 0.0
        """When the progress artifact was last updated (``time.monotonic()``)."""
        if self.active:
            self.progress_id = create_progress_artifact(
                progress=100.0 * (first_step - 1) / total_steps,
                key=f"{self.prefix}-progress",
                description=f"{cfg.trainer.experiment_name} ({self.run_name}): training steps done",
            )

    def step(self, step: int, metrics: dict[str, float], batch: TensorDict | None = None) -> None:
        """Record that ``step`` is done (``metrics`` are that step's; only the progress is published now,
        at most once a second and after the last step) and count the staleness of the samples it trained
        on (``batch``; a replayed batch's is history)."""
        if batch is not None and "weight_version" in batch.keys() and metrics.get("skip/rollout/hit") != 1.0:
            newest = batch["max_weight_version"] if "max_weight_version" in batch.keys() else batch["weight_version"]
            values, counts = torch.unique(step - 1 - newest, return_counts=True)
            for value, count in zip(values.tolist(), counts.tolist()):
                self.staleness[value] = self.staleness.get(value, 0) + count
        now = time.monotonic()
        if self.active and (step == self.total_steps or now - self.progress_shown_at >= PROGRESS_INTERVAL_S):
            update_progress_artifact(artifact_id=self.progress_id, progress=100.0 * step / self.total_steps)
            self.progress_shown_at = now

    def validated_before_training(self, metrics: dict[str, float]) -> None:
        """The step-0 validation (``trainer.val_before_train``), the first point of the validation curve."""
        self.validation_before_training = dict(metrics)

    def finish(
        self,
        rows: list[dict],
        *,
        checkpoint: str | None,
        final_model: str | None,
        caches: list[str],
        cache_lines: list[str] = (),
        links: list[tuple[str, str]] = (),
    ) -> str:
        """Write the reward curve to the run directory and publish the metrics table, the summary, the
        config, the staleness histogram (when some sample was off-policy) and the experiment's ``latest``
        pointer; ``rows`` are the run's per-step metrics (each with ``step``), ``cache_lines`` the summary's
        "Step cache" section (markdown lines: what the step cache replayed, rejected and missed), ``links``
        the summary's ``(label, where)`` rows of the trackers' runs and the generation dumps. Returns
        the PNG's location."""
        before = [{"step": 0, **self.validation_before_training}] if self.validation_before_training else []
        curve_rows = before + rows
        png = png_bytes(reward_figure(curve_rows, self.cfg.trainer.experiment_name), dpi=100)
        png_url = join(self.cfg.trainer.default_local_dir, "reward_curve.png")
        fs, path = open_fs(png_url)
        atomic_write(fs, path, png)
        if self.active:
            name = f"{self.cfg.trainer.experiment_name} ({self.run_name})"
            create_table_artifact(
                table=metrics_table(rows), key=f"{self.prefix}-metrics", description=f"{name}: metrics per step"
            )
            create_markdown_artifact(
                markdown=self.summary(
                    rows, checkpoint, final_model, caches, png_url, png, cache_lines=cache_lines, links=links
                ),
                key=f"{self.prefix}-summary",
                description=f"{name}: run summary",
            )
            config = yaml.safe_dump(config_as_dict(self.cfg), sort_keys=False)
            create_markdown_artifact(
                markdown=f"```yaml\n{config.rstrip()}\n```", key=f"{self.prefix}-config", description=f"{name}: config"
            )
            if set(self.staleness) - {0}:  # a histogram of on-policy samples only would say "0: 100%"
                create_markdown_artifact(
                    markdown=staleness_histogram(self.staleness),
                    key=f"{self.prefix}-staleness",
                    description=f"{name}: staleness of the trained samples",
                )
            create_markdown_artifact(
                markdown=self.pointer(),
                key=f"{self.slug}-latest",
                description=f"{self.cfg.trainer.experiment_name}: the latest run",
            )
        return png_url

    def summary(
        self,
        rows: list[dict],
        checkpoint: str | None,
        final_model: str | None,
        caches: list[str],
        png_url: str,
        png: bytes,
        *,
        cache_lines: list[str] = (),
        links: list[tuple[str, str]] = (),
    ) -> str:
        """The summary artifact's markdown: short enough to read without scrolling past the curve (with a
        "Step cache" section of ``cache_lines``, given as they are, when there are any)."""
        trainer = self.cfg.trainer
        last = rows[-1] if rows else {}
        headline = metrics_table([last], stage_timings=False)[0] if last else {}
        places = [
            ("run directory", trainer.default_local_dir),
            ("checkpoint", checkpoint),
            ("final model", final_model),
            *(("cache", cache) for cache in caches),
            *links,
        ]
        return "\n".join(
            [
                f"# {trainer.experiment_name} ({trainer.project_name}), run {self.run_name}",
                "",
                f"`{self.cfg.algorithm.adv_estimator}`, {'with' if self.cfg.use_critic else 'no'} critic, "
                f"mode `{trainer.mode}`: {last.get('step', 0)} of {self.total_steps} steps.",
                "",
                markdown_table(headline),
                "",
                f"![reward curve](data:image/png;base64,{base64.b64encode(png).decode()})",
                "",
                markdown_table([(label, f"`{where}`") for label, where in places if where], header=("", "where")),
                "",
                *(["## Step cache", "", *cache_lines, ""] if cache_lines else []),
                f"Per-step metrics: artifact `{self.prefix}-metrics`; config: artifact `{self.prefix}-config`; "
                f"curve: `{png_url}`.",
            ]
        )

    def pointer(self) -> str:
        """The ``<slug>-latest`` markdown: which run is the experiment's latest, and its artifact keys."""
        return "\n".join(
            [
                f"# {self.cfg.trainer.experiment_name}: latest run `{self.run_name}`",
                "",
                *(f"* {what}: `{self.prefix}-{what}`" for what in ("summary", "metrics", "config")),
            ]
        )


def publish_validation_samples(cfg: PPOConfig, step: int, rows: list[dict], task_run_id: str | None) -> None:
    """A table of a few validation samples (``prompt``, ``response``, ``score``) on the page of the task run
    that scored them; nothing outside a flow run. The run goes on when the server refuses it (a warning)."""
    if task_run_id is None:
        return
    table = [{**row, "score": _cell(row["score"], digits=4)} for row in rows]
    try:
        TableArtifact(
            table=table,
            description=f"{cfg.trainer.experiment_name}: validation samples at step {step}",
            task_run_id=task_run_id,
        ).create()
    except Exception as error:
        logger.warning("could not publish the validation samples of step %d: %r", step, error)


def staleness_histogram(counts: dict[int, int], width: int = 40) -> str:
    """Markdown: the trained samples by staleness (0: sampled with the newest weights), as a table with a
    bar per row; what the off-policy modes trade for their speed, at a glance."""
    total = sum(counts.values())
    widest = max(counts.values())
    lines = [
        "# Staleness of the trained samples",
        "",
        "Weight updates between the weights a sample's newest token was drawn with and the weights it "
        f"trained (verl's `trajectory_staleness`); {total} samples.",
        "",
        "| staleness | samples | share | |",
        "|---|---|---|---|",
    ]
    for value in range(min(counts), max(counts) + 1):
        count = counts.get(value, 0)
        lines.append(f"| {value} | {count} | {count / total:.1%} | {'█' * round(width * count / widest)} |")
    return "\n".join(lines)


def metrics_table(rows: list[dict], *, stage_timings: bool = True) -> list[dict]:
    """One table row per step: ``step``, the :data:`TABLE_COLUMNS`, each stage's timing (unless not
    ``stage_timings``) and every ``val-core/*`` metric (as ``val/...``) that some row has a value for;
    missing values are ``""``."""
    present = {name for row in rows for name, value in row.items() if value is not None}
    stages = [
        name
        for name in dict.fromkeys(name for row in rows for name in row)
        if stage_timings and name.startswith(TIMING) and name in present and name not in TABLE_COLUMNS
    ]
    validation = sorted(name for name in present if name.startswith("val-core/"))
    columns = {
        "step": "step",
        **{name: label for name, label in TABLE_COLUMNS.items() if name in present},
        **{name: name.removeprefix(TIMING) + "_s" for name in stages},
        **{name: "val/" + name.removeprefix("val-core/") for name in validation},
    }
    return [
        {label: _cell(row.get(name), digits=3 if name.startswith(TIMING) else 4) for name, label in columns.items()}
        for row in rows
    ]


def markdown_table(row: dict | list[tuple[str, object]], header: tuple[str, str] = ("metric", "value")) -> str:
    """A two-column markdown table of one row's ``(name, value)`` pairs (``header`` names the columns)."""
    pairs = row.items() if isinstance(row, dict) else row
    lines = [f"| {header[0]} | {header[1]} |", "| --- | --- |"]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in pairs])


def reward_figure(rows: list[dict], title: str) -> Figure:
    """Training score per step, and validation rewards as markers, on an Agg canvas (no display needed). matplotlib
    is imported here, at the run's end, so that no start of ``ppoflow train`` waits for it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    scored = [row for row in rows if _finite(row.get(SCORE))]
    axes.plot([row["step"] for row in scored], [row[SCORE] for row in scored], label="train score")
    for name in sorted({name for row in rows for name in row if CORE_MEAN.match(name)}):
        points = [row for row in rows if _finite(row.get(name))]
        axes.plot(
            [row["step"] for row in points],
            [row[name] for row in points],
            "o--",
            label="val " + name.removeprefix("val-core/"),
        )
    axes.set(xlabel="step", ylabel="reward", title=title)
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend(loc="best")
    figure.tight_layout()
    return figure


def png_bytes(figure: Figure, *, dpi: int) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def _cell(value, digits: int) -> str | int | float:
    """A table cell: ``""`` for a missing value, floats to ``digits`` significant digits, ints as they are."""
    if value is None:
        return ""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else str(value)
    return value


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
