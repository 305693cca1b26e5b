"""Padding-free forward passes and token-budget micro-batches (verl's ``use_remove_padding``, ``use_dynamic_bsz``).

A row's tokens are its prompt without the left padding and its response up to its extent (its last model or tool
token). :func:`pack` lays a micro-batch's rows end to end in one row [1, T] whose position ids restart at 0 per
sequence: transformers then keeps attention inside each sequence (a block-diagonal causal mask for sdpa and eager,
varlen kernels for flash attention). :func:`to_rows` puts per-token outputs back as [N, R]. :func:`token_budget_parts`
cuts rows into micro-batches of at most a budget of tokens, as many on every data-parallel rank.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from tensordict import TensorDict

from ppoflow.storage.batch import response_extent


def response_positions(batch: TensorDict) -> torch.Tensor:
    """[N, R] bool: the response positions inside each row's extent, those the forward passes predict."""
    width = batch["responses"].shape[1]
    return torch.arange(width, device=batch["responses"].device) < response_extent(batch).unsqueeze(1)


def sequence_lengths(batch: TensorDict) -> list[int]:
    """Each row's real tokens (prompt + response up to its extent): what a micro-batch's budget counts."""
    return (batch["prompt_mask"].sum(dim=1) + response_extent(batch)).tolist()


def pack(
    input_ids: torch.Tensor, kept: torch.Tensor, position_ids: torch.Tensor, prompt_length: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``kept`` tokens of padded ``input_ids`` [N, P + R] as one row: ``(input_ids [1, T], position_ids
    [1, T], index [K])``, ``index`` the packed positions whose outputs predict the response tokens at
    ``positions`` [N, R], in row-major order (those of column P - 1 + j predict response token j)."""
    packed_index = (kept.flatten().cumsum(0) - 1).view_as(kept)
    response_length = positions.shape[1]
    index = packed_index[:, prompt_length - 1 : prompt_length + response_length - 1][positions]
    return input_ids[kept].unsqueeze(0), position_ids[kept].unsqueeze(0), index


def to_rows(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-token values [K, ...] of the response ``positions`` [N, R] (row-major) as [N, R, ...], zero elsewhere."""
    rows = flat.new_zeros((*positions.shape, *flat.shape[1:]))
    rows[positions] = flat
    return rows


def karmarkar_karp(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``lengths`` in ``parts`` groups of near-equal sums (some empty when there are fewer items), by
    Karmarkar and Karp's largest differencing method: repeatedly merge the two partial partitions whose sums
    spread most, pairing the heaviest group of one with the lightest of the other. Each group is sorted."""
    heap = []
    for index, length in enumerate(lengths):
        groups = [(length, [index])] + [(0, []) for _ in range(parts - 1)]  # heaviest first
        heap.append((-length, index, groups))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, order, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = sorted(
            ((a + b, members + others) for (a, members), (b, others) in zip(first, reversed(second))),
            key=lambda group: -group[0],
        )
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], order, merged))
    groups = heap[0][2] if heap else [(0, []) for _ in range(parts)]
    return [sorted(members) for _, members in groups]


def token_budget_parts(shares: Sequence[Sequence[int]], budget: int) -> list[list[list[int]]]:
    """Each share's rows (given by their token lengths; one share per data-parallel rank) cut into the same
    number of micro-batches of at most ``budget`` tokens: the fewest, from ceil(tokens / budget) of the largest
    share up, for which :func:`karmarkar_karp` makes every group of every share fit. Per share: its groups of
    indices into the share. ValueError when one row alone exceeds the budget."""
    longest = max((length for share in shares for length in share), default=0)
    if longest > budget:
        raise ValueError(f"a sequence of {longest} tokens exceeds the micro-batch token budget of {budget}")
    count = max([1, *(math.ceil(sum(share) / budget) for share in shares)])
    while True:
        cuts = [karmarkar_karp(share, count) for share in shares]
        if all(sum(share[row] for row in group) <= budget for share, cut in zip(shares, cuts) for group in cut):
            return cuts
        count += 1
