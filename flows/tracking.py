"""Where step metrics go: ``metrics.jsonl`` in the run directory (always), a console progress bar
with the live reward (``console``), and TensorBoard event files (``tensorboard``)."""

from __future__ import annotations

import json
import math
import time

from ppoflow.storage.fs import atomic_write, open_fs

PROGRESS_KEYS = {"critic/score/mean": "score", "timing_s/step": "s/step"}
"""What the progress bar shows after each step (plus the latest validation reward)."""


class Tracker:
    """Fan one ``{metric: value}`` row per step out to the configured sinks."""

    def __init__(self, run_dir: str, loggers: list[str], total_steps: int, *, first_step: int = 1):
        self.fs, self.run_dir = open_fs(run_dir)
        self.fs.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = f"{self.run_dir}/metrics.jsonl"
        if self.fs.exists(self.metrics_path):
            if first_step > 1:  # resumed: keep the rows up to the checkpoint, drop what the crashed run logged after it
                kept = [line for line in self.fs.cat_file(self.metrics_path).decode().splitlines(keepends=True)
                        if line.strip() and json.loads(line)["step"] < first_step]
                atomic_write(self.fs, self.metrics_path, "".join(kept).encode())
            else:  # an earlier run of this experiment: keep its rows aside
                stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
                self.fs.mv(self.metrics_path, f"{self.run_dir}/metrics-{stamp}.jsonl")
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
        if self.progress is not None:
            shown = {label: f"{metrics[key]:.3g}" for key, label in PROGRESS_KEYS.items() if key in metrics}
            validation = [value for key, value in metrics.items() if key.startswith("val-core/") and "/reward/mean@" in key]
            if validation:
                shown["val"] = f"{validation[0]:.3g}"
            self.progress.set_postfix(shown, refresh=False)
            self.progress.update(1)

    def note(self, message: str) -> None:
        """A line of text (validation results, checkpoints, resumes): above the progress bar, or printed
        (inside a flow run, printed lines also reach the Prefect run's logs)."""
        if self.progress is not None:
            self.progress.write(message)
        else:
            print(message)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of a run directory's ``metrics.jsonl``."""
    fs, path = open_fs(run_dir)
    return [json.loads(line) for line in fs.cat_file(f"{path}/metrics.jsonl").decode().splitlines() if line]


def json_number(value: float) -> float | None:
    """``value`` as JSON can hold it: non-finite numbers (which JSON lacks) become null."""
    return value if math.isfinite(value) else None
