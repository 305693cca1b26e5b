"""The rows of a batch KV cache, for the continuous-batching engine (:mod:`ppoflow.workers.rollout.serving`): one time
axis shared by every running row, left-padded, so joining rows are padded in, finished rows selected out and
columns no row uses dropped. Works on a full-attention transformers ``DynamicCache`` (its layers' ``keys`` and
``values``, ``[rows, heads, columns, head_dim]``). Layout: docs/rollout_service.md#the-engine.
"""

from __future__ import annotations

import torch


def left_padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` attention mask whose row ``i`` has ones in its last ``lengths[i]`` columns."""
    columns = torch.arange(width, device=lengths.device)
    return (columns.unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's ``(keys, values)``, ``[rows, heads, columns, head_dim]``, of a full-attention ``DynamicCache``
    (its layers are ``DynamicLayer``s; the engine refuses other models)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_cache_layers(cache, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace each layer's keys and values in place (what ``DynamicLayer.batch_select_indices`` does)."""
    for layer, (keys, values) in zip(cache.layers, layers, strict=True):
        layer.keys, layer.values = keys, values


def _left_pad(states: torch.Tensor, width: int) -> torch.Tensor:
    """``states`` ``[rows, heads, columns, head_dim]`` with zero columns prepended up to ``width``."""
    return torch.nn.functional.pad(states, (0, 0, width - states.shape[-2], 0))


def join_rows(
    running: list[tuple[torch.Tensor, torch.Tensor]], joining: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the running rows then the joining rows on one time axis, the shorter side left-padded."""
    width = max(running[0][0].shape[-2], joining[0][0].shape[-2])
    return [
        (
            torch.cat([_left_pad(keys, width), _left_pad(new_keys, width)]),
            torch.cat([_left_pad(values, width), _left_pad(new_values, width)]),
        )
        for (keys, values), (new_keys, new_values) in zip(running, joining, strict=True)
    ]


def select_rows(
    layers: list[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, width: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, only ``rows`` and only the last ``width`` columns."""
    return [
        (keys[rows, :, keys.shape[-2] - width :], values[rows, :, values.shape[-2] - width :])
        for keys, values in layers
    ]
