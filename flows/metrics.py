"""Per-step data metrics with verl's names, computed from the finished step batch."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def data_metrics(batch: TensorDict) -> dict[str, float]:
    """``critic/{score,rewards,advantages,returns,values}/{mean,max,min}``, lengths and clip ratios."""
    mask = batch["response_mask"]
    valid = mask.bool()
    metrics: dict[str, float] = {}

    def summarize(name: str, values: torch.Tensor) -> None:
        metrics[f"{name}/mean"] = float(values.float().mean())
        metrics[f"{name}/max"] = float(values.max())
        metrics[f"{name}/min"] = float(values.min())

    summarize("critic/score", batch["token_level_scores"].sum(dim=1))
    summarize("critic/rewards", batch["token_level_rewards"].sum(dim=1))
    summarize("critic/advantages", batch["advantages"][valid])
    summarize("critic/returns", batch["returns"][valid])
    if "values" in batch.keys():
        summarize("critic/values", batch["values"][valid])
    response_length = mask.sum(dim=1).float()
    summarize("response_length", response_length)
    metrics["response_length/clip_ratio"] = float((response_length == mask.shape[1]).float().mean())
    summarize("prompt_length", batch["prompt_mask"].sum(dim=1).float())
    return metrics


def aggregate_updates(parts: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from those of its mini-batch updates (separate_async's ``parameter_sync_step``),
    as verl's MetricsAggregator combines them: ``timing_s/*``, evicted-sample and skipped-update counts summed, names
    with ``max``/``min`` taking the max/min, every other value the mean over the updates."""
    combined: dict[str, float] = {}
    for name in {name for part in parts for name in part}:
        values = [part[name] for part in parts if name in part]
        if name.startswith("timing_s/") or name.split("/")[-1] in ("evicted_samples", "nonfinite_skipped"):
            combined[name] = sum(values)
        elif "max" in name.rsplit("/", 1)[-1]:
            combined[name] = max(values)
        elif "min" in name.rsplit("/", 1)[-1]:
            combined[name] = min(values)
        else:
            combined[name] = sum(values) / len(values)
    return combined
