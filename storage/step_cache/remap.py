"""Fitting a cached step's trajectories onto the current step's prompts (verl's V1 replay mapping)."""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict

from ppoflow.storage.batch import non_tensor_column, with_non_tensor_columns

logger = logging.getLogger(__name__)


def remap_to_prompts(cached: TensorDict, prompt_uids: list[str], n: int) -> TensorDict:
    """Fit a cached step's trajectories onto the current step's prompts (verl's V1 replay mapping).

    Cached trajectories are grouped by ``uid`` in first-appearance order; prompt ``i`` takes group
    ``i % G`` and its session ``s`` takes the group's trajectory ``s % len(group)``. The result has
    ``len(prompt_uids) * n`` rows, prompt-major, with ``uid`` and ``group_index`` rewritten.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if "uid" not in cached.keys():
        raise ValueError("cached batch has no 'uid' column to group trajectories by")
    groups: dict[str, list[int]] = {}
    for row, uid in enumerate(non_tensor_column(cached, "uid")):
        groups.setdefault(uid, []).append(row)
    if not groups:
        raise ValueError("cached batch holds no trajectory groups")
    group_rows = list(groups.values())
    if len(group_rows) != len(prompt_uids):
        logger.warning(
            "cached step has %d prompt groups but this step has %d prompts; %s",
            len(group_rows),
            len(prompt_uids),
            "cycling through the cached groups" if len(group_rows) < len(prompt_uids) else "using the first groups",
        )
    odd_sizes = sorted({len(rows) for rows in group_rows if len(rows) != n})
    if odd_sizes:
        logger.warning(
            "cached groups of %s trajectories differ from n=%d; cycling or truncating their sessions", odd_sizes, n
        )
    selected: list[int] = []
    for prompt_index in range(len(prompt_uids)):
        rows = group_rows[prompt_index % len(group_rows)]
        selected.extend(rows[session % len(rows)] for session in range(n))
    remapped = cached[torch.tensor(selected, dtype=torch.long)]
    remapped.set("group_index", torch.arange(len(prompt_uids), dtype=torch.int64).repeat_interleave(n))
    return with_non_tensor_columns(remapped, {"uid": [uid for uid in prompt_uids for _ in range(n)]})
