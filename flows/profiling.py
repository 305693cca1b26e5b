"""The flow's side of the profiler (verl's ``global_profiler``): the profiled roles' processes record each step
of ``global_profiler.steps`` (:mod:`ppoflow.workers.profiler`), and the run's summary artifact links the files.
Details: docs/trackers.md#profiler.
"""

from __future__ import annotations

from ppoflow.configs.schema import PPOConfig
from ppoflow.storage.fs import open_fs
from ppoflow.workers.profiler import ProfileSettings
from ppoflow.workers.roles import Workers


class StepProfiler:
    """Starts and stops the workers' profilers around the steps ``global_profiler.steps`` names."""

    def __init__(self, cfg: PPOConfig, workers: Workers):
        self.settings = ProfileSettings.of(cfg)
        self.steps = set(cfg.global_profiler.steps or ())
        self.workers = workers
        self.started: list = []

    def start(self, step: int) -> None:
        if self.settings is not None and step in self.steps:
            self.started = self.workers.start_profile(step, self.settings)

    def stop(self, step: int) -> list[str]:
        """The files written for ``step`` (none when it is not profiled)."""
        if self.settings is None or step not in self.steps:
            return []
        return self.workers.stop_profile(self.settings, self.started)


def profile_links(cfg: PPOConfig) -> list[tuple[str, str]]:
    """The summary's row for the profiler's files: their directory, and how many it holds."""
    settings = ProfileSettings.of(cfg)
    if settings is None:
        return []
    fs, path = open_fs(settings.save_path)
    found = fs.find(path) if fs.exists(path) else []
    return [(f"profiler traces ({len(found)} files)", settings.save_path)]
