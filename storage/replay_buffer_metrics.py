"""The metrics of a replay-buffer sample, under verl's names (``training/off_policy/...``).

How many groups were evicted as stale or failed, and the spans and staleness of the sampled trajectories, as
``/mean``, ``/max`` and ``/min`` summaries. Kept apart from the buffer so its sampling loop reads alone.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict


def sample_metrics(prefix: str, step: int, batch: TensorDict, stale_spans: list[int], failed: int) -> dict[str, float]:
    """The metrics of the ``batch`` sampled for ``step`` after evicting ``stale_spans`` and ``failed`` groups."""
    metrics = {
        f"{prefix}off_policy/evicted_samples": float(len(stale_spans)),
        f"{prefix}rollout_failure/evicted_samples": float(failed),
    }
    if stale_spans:
        metrics.update(summary(f"{prefix}off_policy/evicted_samples_staleness", torch.tensor(stale_spans)))
    oldest, newest = batch["weight_version"], batch["max_weight_version"]
    metrics.update(summary(f"{prefix}off_policy/trajectory_spans", newest - oldest + 1))
    metrics.update(summary(f"{prefix}off_policy/trajectory_staleness", (step - 1) - newest))
    metrics.update(summary(f"{prefix}off_policy/trajectory_staleness_worst", (step - 1) - oldest))
    return metrics


def summary(name: str, values: torch.Tensor) -> dict[str, float]:
    """``{name}/mean``, ``{name}/max`` and ``{name}/min`` of ``values``."""
    values = values.double()
    return {
        f"{name}/mean": values.mean().item(),
        f"{name}/max": values.max().item(),
        f"{name}/min": values.min().item(),
    }
