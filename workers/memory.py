"""Memory, measured: each role process reports its peaks once a step (:class:`ReportsMemory`, collected by
:class:`MemoryReports` into verl's ``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb``,
``perf/cpu_memory_used_gb`` and ``perf/<role>/...``). What the roles will hold, foreseen before anything loads, is
:mod:`ppoflow.workers.memory_estimate`. Details: docs/architecture.md#memory.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

GIB = 1024**3

NODE_MEMORY = "cpu_memory_used_gb"
"""verl's ``perf/cpu_memory_used_gb``: the node's memory in use (psutil's ``virtual_memory().used``, MemTotal -
MemAvailable), which verl reads in the actor's update; reported as the actor saw it at the end of the step."""

VERL_NAMES = ("max_memory_allocated_gb", "max_memory_reserved_gb", NODE_MEMORY)
"""The figures verl reports from the actor under ``perf/<name>``."""


# ------------------------------------------------------------------------------------- measured


def gpu_memory() -> dict[str, float]:
    """The peaks of torch's CUDA allocator in this process since the last call (the largest over its devices),
    reset after reading; empty when the process has not used CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    devices = range(torch.cuda.device_count())
    stats = {
        "max_memory_allocated_gb": max(torch.cuda.max_memory_allocated(device) for device in devices) / GIB,
        "max_memory_reserved_gb": max(torch.cuda.max_memory_reserved(device) for device in devices) / GIB,
    }
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    return stats


def process_memory() -> dict[str, float]:
    """This process's figures since the last call: the GPU peaks (:func:`gpu_memory`), ``max_rss_gb``, its
    peak resident memory (Linux's VmHWM, reset after reading through ``/proc/self/clear_refs``; where the kernel
    refuses the reset, the peak since the process started), and the node's memory in use (:data:`NODE_MEMORY`).
    No CPU figures where there is no ``/proc`` (not Linux)."""
    stats = gpu_memory()
    if not os.path.exists("/proc/self/status"):
        return stats
    peak = proc_kib("/proc/self/status", "VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # Linux >= 4.0: the peak restarts from the current resident size
    except OSError:
        pass
    used = proc_kib("/proc/meminfo", "MemTotal") - proc_kib("/proc/meminfo", "MemAvailable")
    return {**stats, "max_rss_gb": peak * 1024 / GIB, NODE_MEMORY: used * 1024 / GIB}


def memory_in_use_gb(device: torch.device) -> float:
    """What this process holds now: torch's allocated CUDA memory on a GPU device, else its resident memory
    (VmRSS; 0 where there is no ``/proc``). Read around a colocated engine's sleep and wake."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / GIB
    if not os.path.exists("/proc/self/status"):
        return 0.0
    return proc_kib("/proc/self/status", "VmRSS") * 1024 / GIB


def release_freed_memory() -> bool:
    """Give the pages of memory this process has freed back to the system; False where the allocator offers no
    way. Why: freed memory stays with the allocator (glibc's heap keeps what torch's CPU tensors under 32 MiB
    free; jemalloc, as a local Ray's workers run it, keeps every freed page:
    :data:`~ppoflow.workers.launcher.JEMALLOC_CONF`), and the next stage would sit on top of it
    (:mod:`ppoflow.workers.stage` calls this at each stage's end). jemalloc purges its arenas; glibc trims its heap."""
    mallctl = _allocator_symbol("mallctl")
    if mallctl is not None:
        return mallctl(f"arena.{MALLCTL_ARENAS_ALL}.purge".encode(), None, None, None, 0) == 0
    trim = _allocator_symbol("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


MALLCTL_ARENAS_ALL = 4096
"""jemalloc's ``MALLCTL_ARENAS_ALL``: ``arena.<i>.purge`` with it for ``<i>`` purges every arena."""


@functools.cache
def _allocator_symbol(name: str):
    """``name`` among the symbols this process has loaded: jemalloc's ``mallctl`` where it is preloaded,
    glibc's ``malloc_trim``; None where neither is (musl, macOS, Windows)."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError, TypeError):
        return None


def proc_kib(path: str, name: str) -> int:
    """The ``name:  N kB`` line of a /proc file, in KiB."""
    with open(path) as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(f"{name}:"))


class ReportsMemory:
    """Mixed into every role's worker class: :meth:`memory_stats`, this process's peaks since the last call."""

    def memory_stats(self) -> dict[str, float]:
        return process_memory()


def largest(replies: list[dict[str, float]]) -> dict[str, float]:
    """Figures of several processes of one role (data-parallel ranks, replicas) as one: the largest of each."""
    merged: dict[str, float] = {}
    for reply in replies:
        for name, value in reply.items():
            merged[name] = max(merged.get(name, value), value)
    return merged


def memory_metrics(by_role: dict[str, dict[str, float]]) -> dict[str, float]:
    """Step metrics from each role's figures: ``perf/<role>/<name>`` (the node's memory left out), and the
    actor's as verl names them (``perf/<name>``, :data:`VERL_NAMES`)."""
    metrics = {
        f"perf/{role}/{name}": value
        for role, stats in by_role.items()
        for name, value in stats.items()
        if name != NODE_MEMORY
    }
    actor = by_role.get("actor", {})
    metrics.update({f"perf/{name}": actor[name] for name in VERL_NAMES if name in actor})
    return metrics


LATE_WAIT_S = 0.5
"""How long the step end waits for a role still busy (then read one step later, without waiting)."""


class MemoryReports:
    """Every role's figures once a step, asked of all their processes at once (``roles``: name -> a role with
    ``start_memory_stats``, references of Ray calls). A Ray actor runs one call at a time, so a role busy at the
    end of a step (one_step_off's rollout, generating the next batch) answers only when it is done: it is waited
    for once, up to :data:`LATE_WAIT_S`, and from then on read at the next step without waiting. Its call, queued
    behind that generation, reports the peaks up to it - those of the batch the next step trains on."""

    def __init__(self, roles: dict[str, Any], get):
        self.roles, self.get = roles, get
        self.pending: dict[str, list] = {}
        self.late: set[str] = set()

    def collect(self) -> dict[str, float]:
        for name, role in self.roles.items():
            if name not in self.pending:
                self.pending[name] = role.start_memory_stats()
        waited = [ref for name, refs in self.pending.items() if name not in self.late for ref in refs]
        ready = set(_ready(waited, LATE_WAIT_S))
        ready |= set(_ready([ref for name in self.late for ref in self.pending[name]], 0.0))
        answered = [name for name, refs in self.pending.items() if ready.issuperset(refs)]
        self.late |= set(self.pending) - set(answered)
        replies = iter(self.get([ref for name in answered for ref in self.pending[name]]))
        by_role = {name: largest([next(replies) for _ in self.pending.pop(name)]) for name in answered}
        for name in self.late & set(answered):  # its next figures come with the next step
            self.pending[name] = self.roles[name].start_memory_stats()
        return memory_metrics(by_role)


def _ready(references: list, timeout_s: float) -> list:
    """Those of ``references`` whose values are ready, waiting up to ``timeout_s`` for all of them."""
    import ray

    if not references:
        return []
    ready, _ = ray.wait(references, num_returns=len(references), timeout=timeout_s, fetch_local=False)
    return ready
