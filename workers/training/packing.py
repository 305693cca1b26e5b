"""Padding-free forward passes and token-budget micro-batches (verl's ``use_remove_padding``, ``use_dynamic_bsz``).

A row's tokens are its prompt without the left padding and its response up to its extent (its last model or tool
token). :func:`pack` lays a micro-batch's sequences end to end, in one row for flash attention's varlen kernels or
in rows as wide as the longest sequence for sdpa and eager (whose block-diagonal causal mask costs the square of
a row's width), position ids restarting at 0 per sequence so that transformers keeps attention inside each. Under
sdpa and eager the samples of one prompt (a GRPO group) may share one copy of it, their responses behind it under
a mask of their own, where :func:`sharing_pays` says that costs less. :func:`to_rows` puts per-token outputs back
as [N, R]. :func:`token_budget_parts` cuts rows into micro-batches of at most a budget of tokens, as many on every
data-parallel rank, keeping a prompt's samples together where they fit (:func:`budget_items`).
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


def prompt_groups(batch: TensorDict) -> torch.Tensor:
    """[N] long: an id per distinct prompt (its tokens and padding), 0 to G - 1; a GRPO group's samples share one."""
    prompts = torch.cat([batch["prompts"], batch["prompt_mask"].long()], dim=1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1]


def unit_lengths(kept: torch.Tensor, prompt_length: int, groups: torch.Tensor) -> torch.Tensor:
    """[G] tokens of each group's unit: its prompt once, then every one of its rows' responses."""
    prompt_lengths = kept[:, :prompt_length].sum(dim=1)
    first = prompt_lengths.new_zeros(int(groups.max()) + 1 if len(groups) else 0).scatter_(0, groups, prompt_lengths)
    return first.index_add(0, groups, kept[:, prompt_length:].sum(dim=1))


def layout_cost(lengths: Sequence[int], pair_weight: float) -> float:
    """What a forward pass over ``lengths`` in rows as wide as the longest (:func:`first_fit`) costs, in tokens:
    B x W token slots, each W x ``pair_weight`` more for attention (one attended pair's cost against the rest of a
    token's work)."""
    width = max(lengths, default=0)
    slots = len(first_fit(lengths, width)[2]) * width
    return slots * (1 + width * pair_weight)


def sharing_pays(kept: torch.Tensor, prompt_length: int, groups: torch.Tensor, pair_weight: float) -> bool:
    """Whether laying each group's responses behind one copy of its prompt costs less (:func:`layout_cost`) than a
    unit per sequence, as it does for a GRPO group until attention over its responses outweighs the prompt tokens
    saved."""
    if len(groups) == 0 or int(groups.max()) + 1 == len(groups):
        return False
    shared = unit_lengths(kept, prompt_length, groups).tolist()
    return layout_cost(shared, pair_weight) < layout_cost(kept.sum(dim=1).tolist(), pair_weight)


def pack(
    input_ids: torch.Tensor,
    kept: torch.Tensor,
    position_ids: torch.Tensor,
    prompt_length: int,
    positions: torch.Tensor,
    *,
    in_rows: bool = False,
    groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ``kept`` tokens of padded ``input_ids`` [N, P + R] laid end to end: ``(input_ids [B, W], position_ids
    [B, W], index [K], mask)``, ``index`` the positions in the flattened [B * W] outputs that predict the response
    tokens at ``positions`` [N, R], in row-major order (those of column P - 1 + j predict response token j).

    A unit is a sequence or, with ``groups`` (:func:`prompt_groups`), a prompt followed by the responses of its
    group's rows. ``in_rows`` False: one row, the units in order (flash attention's varlen kernels take it at no
    cost per pair). True: rows as wide as the longest unit, filled first-fit by decreasing length, each row's
    remainder a block of its own (token 0, positions from 0): sdpa and eager attention then cost B x W x W pairs,
    not T x T. ``mask`` None when every unit is one sequence (the position ids, restarting, keep attention inside
    it), else [B, 1, W, W] bool (:func:`shared_prompt_mask`)."""
    groups = torch.arange(len(kept), device=kept.device) if groups is None else groups
    prompt_kept, response_kept = kept[:, :prompt_length], kept[:, prompt_length:]
    lengths = unit_lengths(kept, prompt_length, groups)
    if in_rows:
        rows, starts, used = (part.to(kept.device) for part in first_fit(lengths.tolist(), int(lengths.max())))
    else:
        rows, starts, used = torch.zeros_like(lengths), lengths.cumsum(0) - lengths, lengths.sum().view(1)
    row_width = int(used.max()) if len(used) else 0
    unit_start = (rows * row_width + starts)[groups]  # each row's unit, in the flattened rows
    response_start = unit_start + prompt_kept.sum(dim=1) + earlier_responses(response_kept.sum(dim=1), groups)
    packed_index = (
        torch.cat(  # where each kept token goes in the flattened rows; a group's rows share its prompt
            [
                unit_start.unsqueeze(1) + prompt_kept.cumsum(dim=1),
                response_start.unsqueeze(1) + response_kept.cumsum(dim=1),
            ],
            dim=1,
        )
        - 1
    )
    destination = packed_index[kept]
    packed_ids = input_ids.new_zeros(len(used) * row_width)
    packed_ids[destination] = input_ids[kept]
    columns = torch.arange(row_width, device=kept.device)
    packed_positions = (columns - used.unsqueeze(1)).flatten()  # from 0 in each row's remainder
    packed_positions[destination] = position_ids[kept]
    response_length = positions.shape[1]
    index = packed_index[:, prompt_length - 1 : prompt_length + response_length - 1][positions]
    shape = (len(used), row_width)
    shared = len(lengths) < len(kept)
    mask = shared_prompt_mask(packed_index, kept, prompt_length, groups, shape) if shared else None
    return packed_ids.view(shape), packed_positions.view(shape), index, mask


def earlier_responses(lengths: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """[N]: the response tokens of the rows before each one in its group (its response's offset in the unit)."""
    order = torch.argsort(groups, stable=True)
    before = lengths[order].cumsum(0) - lengths[order]  # over the rows sorted by group
    sizes = torch.bincount(groups)
    group_start = sizes.cumsum(0) - sizes
    offsets = torch.empty_like(lengths)
    offsets[order] = before - before[group_start][groups[order]]
    return offsets


def shared_prompt_mask(
    packed_index: torch.Tensor, kept: torch.Tensor, prompt_length: int, groups: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """[B, 1, W, W] bool, query by key: each token attends to the earlier tokens of its unit on its own path, the
    prompt and its own response, so that every response sees what it would see alone; an unused slot, itself."""
    slots = shape[0] * shape[1]
    unit = -1 - torch.arange(slots, device=kept.device)  # every unused slot a unit of its own
    unit[packed_index[kept]] = groups.unsqueeze(1).expand_as(kept)[kept]
    response = kept.clone()
    response[:, :prompt_length] = False
    path = torch.zeros(slots, dtype=torch.long, device=kept.device)  # 0: the prompt, row + 1: that row's response
    path[packed_index[response]] = (
        torch.arange(1, len(kept) + 1, device=kept.device).unsqueeze(1).expand_as(kept)[response]
    )
    unit, path = unit.view(shape), path.view(shape)
    causal = torch.ones(shape[1], shape[1], dtype=torch.bool, device=kept.device).tril()
    on_path = (path.unsqueeze(1) == 0) | (path.unsqueeze(1) == path.unsqueeze(2))
    return (causal & (unit.unsqueeze(1) == unit.unsqueeze(2)) & on_path).unsqueeze(1)


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


def budget_items(rows: Sequence[int], lengths: Sequence[int], keep_together: torch.Tensor | None, budget: int):
    """``rows`` (their token ``lengths`` indexed by row) as the items a token budget cuts: each row alone or, with
    ``keep_together`` ([N] ids: :func:`prompt_groups`), the rows of one id together in chunks of at most
    ``budget`` tokens, so that a micro-batch holds a prompt's samples side by side for a packed pass to share it."""
    if keep_together is None:
        return [[row] for row in rows]
    chunks: dict[int, list[list[int]]] = {}
    for row in rows:
        group = chunks.setdefault(int(keep_together[row]), [[]])
        if group[-1] and sum(lengths[other] for other in group[-1]) + lengths[row] > budget:
            group.append([])
        group[-1].append(row)
    return [chunk for group in chunks.values() for chunk in group]


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
