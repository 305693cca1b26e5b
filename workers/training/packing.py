"""Padding-free forward passes and token-budget micro-batches (verl's ``use_remove_padding``, ``use_dynamic_bsz``).

A row's tokens are its prompt without the left padding and its response up to its extent (its last model or tool
token). :func:`pack` lays a micro-batch's sequences end to end, in one row for flash attention's varlen kernels or
in rows as wide as the longest sequence for sdpa and eager (whose block-diagonal causal mask costs the square of
a row's width), position ids restarting at 0 per sequence so that transformers keeps attention inside each.
:func:`to_rows` puts per-token outputs back as [N, R]. :func:`token_budget_parts` cuts rows into micro-batches of
at most a budget of tokens, as many on every data-parallel rank.
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
    input_ids: torch.Tensor,
    kept: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_length: int,
    positions: torch.Tensor,
    *,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``kept`` tokens of padded ``input_ids`` [N, P + R] laid end to end: ``(input_ids [B, W], position_ids
    [B, W], index [K])``, ``index`` the positions in the flattened [B * W] outputs that predict the response tokens
    at ``positions`` [N, R], in row-major order (those of column P - 1 + j predict response token j).

    ``width`` None: one row, the sequences in their order (flash attention's varlen kernels take it at no cost per
    pair). Else rows of at most ``width`` tokens, filled first-fit by decreasing length, each row's remainder a
    block of its own (token 0, positions from 0): sdpa and eager attention then cost B x W x W pairs, not T x T."""
    lengths = kept.sum(dim=1)
    if width is None:
        rows, starts, used = torch.zeros_like(lengths), lengths.cumsum(0) - lengths, lengths.sum().view(1)
    else:
        rows, starts, used = (part.to(kept.device) for part in first_fit(lengths.tolist(), width))
    row_width = int(used.max()) if len(used) else 0
    flat_start = (rows * row_width + starts).unsqueeze(1)
    packed_index = flat_start + (kept.cumsum(dim=1) - 1)  # where each kept token goes in the flattened rows
    destination = packed_index[kept]
    packed_ids = input_ids.new_zeros(len(used) * row_width)
    packed_ids[destination] = input_ids[kept]
    columns = torch.arange(row_width, device=kept.device)
    packed_positions = (columns - used.unsqueeze(1)).flatten()  # from 0 in each row's remainder
    packed_positions[destination] = position_ids[kept]
    response_length = positions.shape[1]
    index = packed_index[:, prompt_length - 1 : prompt_length + response_length - 1][positions]
    shape = (len(used), row_width)
    return packed_ids.view(shape), packed_positions.view(shape), index


def first_fit(lengths: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences of ``lengths`` in rows of at most ``width`` tokens, first-fit by decreasing length: each one's
    row and start in it, and each row's tokens used."""
    rows, starts, used = [0] * len(lengths), [0] * len(lengths), []
    for sequence in sorted(range(len(lengths)), key=lambda index: -lengths[index]):
        row = next((row for row, tokens in enumerate(used) if tokens + lengths[sequence] <= width), len(used))
        if row == len(used):
            used.append(0)
        rows[sequence], starts[sequence] = row, used[row]
        used[row] += lengths[sequence]
    return torch.tensor(rows), torch.tensor(starts), torch.tensor(used)


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
