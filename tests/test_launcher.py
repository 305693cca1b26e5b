"""The local Ray a run starts: its worker processes, which hold the models, run at ``ray.worker_niceness``."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import os, ray
from ppoflow.configs import load_config
from ppoflow.workers.launcher import _connect_ray, shutdown_ray
from ppoflow.workers.resources import role_resources

cfg = load_config("grpo_tiny", {overrides!r})
assert _connect_ray(cfg, role_resources(cfg))
niceness = ray.get(ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).remote())
shutdown_ray()
print("niceness", niceness)
"""


def worker_niceness(tiny_overrides: list[str], *words: str) -> int:
    """The niceness of a worker of the local Ray that ``_connect_ray`` starts, in a process of its own (the
    test session's own Ray would be reused instead)."""
    script = CHECK.format(overrides=[*tiny_overrides, *words])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("niceness")[-1])


@pytest.mark.slow  # two Ray starts of their own (~25 s)
def test_ray_workers_run_at_the_configured_niceness(tiny_overrides):
    assert worker_niceness(tiny_overrides) == 0  # the default, not Ray's 15
    assert worker_niceness(tiny_overrides, "ray.worker_niceness=7") == 7
