"""The local Ray a run starts: its worker processes, which hold the models, run at ``ray.worker_niceness`` with
``ray.worker_allocator``'s malloc."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import os, ray
from ppoflow.configs import load_config
from ppoflow.workers.launcher import _connect_ray, shutdown_ray
from ppoflow.workers.resources import role_resources

def worker_process():
    with open("/proc/self/maps") as maps:
        jemalloc = any(line.rstrip().endswith("ray/core/libjemalloc.so") for line in maps)
    return os.getpriority(os.PRIO_PROCESS, 0), jemalloc

cfg = load_config("grpo_tiny", {overrides!r})
assert _connect_ray(cfg, role_resources(cfg))
niceness, jemalloc = ray.get(ray.remote(worker_process).remote())
shutdown_ray()
print("worker", niceness, jemalloc)
"""


def worker_process(tiny_overrides: list[str], *words: str) -> tuple[int, bool]:
    """The niceness of a worker of the local Ray that ``_connect_ray`` starts, and whether it runs Ray's jemalloc,
    in a process of its own (the test session's own Ray would be reused instead)."""
    script = CHECK.format(overrides=[*tiny_overrides, *words])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    niceness, jemalloc = done.stdout.split("worker")[-1].split()
    return int(niceness), jemalloc == "True"


@pytest.mark.slow  # two Ray starts of their own (~25 s)
def test_ray_workers_run_at_the_configured_niceness_and_allocator(tiny_overrides):
    assert worker_process(tiny_overrides) == (0, True)  # the defaults: not Ray's 15, Ray's own jemalloc
    assert worker_process(tiny_overrides, "ray.worker_niceness=7", "ray.worker_allocator=system") == (7, False)
