"""A worker's stage methods (verl's labels: ``rollout_generate``, ``actor_compute_log_prob``,
``ref_compute_log_prob``, ``critic_compute_values``, ``actor_update``, ``critic_update``, ``compute_rm_score``).

Each runs inside a ``record_function`` range under its label, which a profiler trace shows as the stage's window
(:mod:`ppoflow.workers.profiler`), and gives what it freed back to the system when it ends
(:func:`~ppoflow.workers.memory.release_freed_memory`): the next stage, in this process or in another role's on
the same machine, then does not sit on top of memory nothing uses. Details: docs/architecture.md#memory.
"""

from __future__ import annotations

import functools

import torch

from ppoflow.workers.memory import release_freed_memory


def worker_stage(label: str):
    """Run the decorated worker method as the stage ``label``: in its profiler range, then release its memory
    (also when it raised: what it allocated is freed all the same)."""

    def decorate(method):
        @functools.wraps(method)
        def as_stage(*args, **kwargs):
            try:
                with torch.profiler.record_function(label):
                    return method(*args, **kwargs)
            finally:
                release_freed_memory()

        return as_stage

    return decorate
