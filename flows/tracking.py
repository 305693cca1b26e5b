"""Where step metrics go: ``metrics.jsonl`` in the run directory (always), a console progress bar
with the live reward (``console``), TensorBoard event files (``tensorboard``) and the experiment trackers of
:mod:`ppoflow.flows.trackers` (``wandb``, ``mlflow``, ``file``, ``trackio``); a tracker that fails warns once and is
left out for the rest of the run (``metrics.jsonl`` is the record).

``metrics.jsonl`` is appended to, one JSON row per step, so a crash (a power loss, a full disk) can leave
its last line torn. Readers skip such a line with a warning; a resumed run moves it, with the rows of
the steps it is about to run again, to ``metrics.discarded-<UTC stamp>.jsonl`` beside it: set aside,
never silently lost.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import UTC, datetime

from ppoflow.algorithms.validation_metrics import CORE_MEAN
from ppoflow.flows.trackers import BACKENDS, backend
from ppoflow.storage.fs import atomic_write, open_fs

logger = logging.getLogger(__name__)

PROGRESS_KEYS = {"critic/score/mean": "score", "timing_s/step": "s/step"}
"""What the progress bar shows after each step (plus the latest validation reward)."""


class Tracker:
    """Fan one ``{metric: value}`` row per step out to the configured sinks."""

    def __init__(
        self,
        run_dir: str,
        loggers: list[str],
        total_steps: int,
        *,
        first_step: int = 1,
        cfg=None,
        resume_ids: dict[str, str] | None = None,
    ):
        self.fs, self.run_dir = open_fs(run_dir)
        self.fs.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = f"{self.run_dir}/metrics.jsonl"
        if self.fs.exists(self.metrics_path):
            if first_step > 1:  # resumed: keep the rows up to the checkpoint, set aside what comes after it
                self._set_aside_rows_from(first_step)
            else:  # an earlier run of this experiment: keep its rows aside
                self.fs.mv(self.metrics_path, f"{self.run_dir}/metrics-{_utc_stamp()}.jsonl")
        self.progress = None
        self.tensorboard = None
        if "console" in loggers:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=total_steps, initial=first_step - 1, desc="ppo", unit="step", dynamic_ncols=True)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            if "file" not in self.fs.protocol:
                raise ValueError(f"trainer.logger=tensorboard needs a local trainer.default_local_dir, got {run_dir!r}")
            self.tensorboard = SummaryWriter(log_dir=f"{self.run_dir}/tensorboard")
        self.backends, self.ids = [], {}
        for name in (name for name in loggers if name in BACKENDS):
            backend_ = backend(name)
            try:
                self.ids[name] = backend_.start(cfg, resume_id=(resume_ids or {}).get(name), first_step=first_step)
            except Exception as error:  # a tracker that is down or misconfigured: the run goes on without it
                logger.warning("trainer.logger=%s: could not start (%r); the run goes on without it", name, error)
                continue
            self.backends.append(backend_)

    def _each(self, what: str, *args) -> None:
        """Call ``what`` on every backend; one that fails is warned about once and left out from then on."""
        for backend_ in list(self.backends):
            try:
                getattr(backend_, what)(*args)
            except Exception as error:
                logger.warning("trainer.logger=%s failed (%r); the run goes on without it", backend_.name, error)
                self.backends.remove(backend_)

    def state_dict(self) -> dict[str, str]:
        """The tracker runs' ids, kept in a checkpoint so that a resumed run continues them."""
        return {name: run_id for name, run_id in self.ids.items() if run_id is not None}

    def links(self) -> list[tuple[str, str]]:
        """``(logger, where to see the run)`` of each working tracker, and the TensorBoard directory."""
        links = [(f"{backend_.name} run", backend_.link()) for backend_ in self.backends]
        if self.tensorboard is not None:
            links.append(("tensorboard", self.tensorboard.log_dir))
        return [(label, where) for label, where in links if where]

    def log_table(self, step: int, samples: list[dict]) -> None:
        """Validation samples (``input``, ``output``, ``score``) to the trackers that keep tables."""
        self._each("log_table", step, samples)

    def log_file(self, name: str, data: bytes) -> None:
        self._each("log_file", name, data)

    def _set_aside_rows_from(self, first_step: int) -> None:
        """Keep the rows of steps before ``first_step``; move the rows of later steps (which the resumed
        run logs again) and lines that are not rows (a torn last line), byte for byte, to a
        ``metrics.discarded-*`` file, written before ``metrics.jsonl`` is rewritten without them."""
        kept, discarded = [], []
        for _, line in _lines(self.fs.cat_file(self.metrics_path)):
            row = _parse_row(line)
            (kept if row is not None and row["step"] < first_step else discarded).append(line + b"\n")
        if discarded:
            aside = f"{self.run_dir}/metrics.discarded-{_utc_stamp()}.jsonl"
            atomic_write(self.fs, aside, b"".join(discarded))
            logger.warning(
                "resuming at step %d: set aside %d line(s) of %s (rows of steps from %d on, or torn) in %s",
                first_step,
                len(discarded),
                self.metrics_path,
                first_step,
                aside,
            )
        atomic_write(self.fs, self.metrics_path, b"".join(kept))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one step's metrics in every sink."""
        line = json.dumps({"step": step, **{k: json_number(v) for k, v in sorted(metrics.items())}}) + "\n"
        if "file" in self.fs.protocol:
            with self.fs.open(self.metrics_path, "a") as handle:
                handle.write(line)
        else:  # object stores cannot append: rewrite the (small) file
            previous = self.fs.cat_file(self.metrics_path).decode() if self.fs.exists(self.metrics_path) else ""
            self.fs.pipe_file(self.metrics_path, (previous + line).encode())
        if self.tensorboard is not None:
            for name, value in metrics.items():
                self.tensorboard.add_scalar(name, value, global_step=step)
        self._each("log", step, metrics)
        if self.progress is not None:
            shown = {label: f"{metrics[key]:.3g}" for key, label in PROGRESS_KEYS.items() if key in metrics}
            validation = [value for key, value in metrics.items() if CORE_MEAN.match(key)]
            if validation:
                shown["val"] = f"{validation[0]:.3g}"
            self.progress.set_postfix(shown, refresh=False)
            self.progress.update(1)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self._each("finish")


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of a run directory's ``metrics.jsonl``; a torn last line (a crash mid-append) is skipped
    with a warning, any other line that is not a row raises ``ValueError`` naming the file and line."""
    fs, path = open_fs(run_dir)
    url = f"{path}/metrics.jsonl"
    lines = _lines(fs.cat_file(url))
    rows = []
    for position, (number, line) in enumerate(lines):
        row = _parse_row(line)
        if row is not None:
            rows.append(row)
        elif position == len(lines) - 1:
            logger.warning("skipping the torn last line (line %d) of %s: %r", number, url, line[:80])
        else:
            raise ValueError(f"{url}: line {number} is not a metrics row: {line[:80]!r}")
    return rows


def json_number(value: float) -> float | None:
    """``value`` as JSON can hold it: non-finite numbers (which JSON lacks) become null."""
    return value if math.isfinite(value) else None


def _lines(data: bytes) -> list[tuple[int, bytes]]:
    """The non-blank lines of a ``metrics.jsonl`` file's bytes, with their line numbers (from 1)."""
    return [(number, line) for number, line in enumerate(data.splitlines(), 1) if line.strip()]


def _parse_row(line: bytes) -> dict | None:
    """One ``metrics.jsonl`` line as a row (a JSON object with an integer ``step``), None if it is not one."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deeply
        return None
    return row if isinstance(row, dict) and type(row.get("step")) is int else None


def _utc_stamp() -> str:
    """A UTC time stamp for the names of set-aside files, to the microsecond so that two never collide."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
