"""Finding and describing NaN and infinite values: in per-sample tensors (rewards, advantages) and in named
scalars (losses, gradient norms).

A non-finite reward trains nothing (every gradient it reaches is NaN) and yet a run that skips its updates
silently looks like a run that trained. These helpers say which samples or values are at fault, in words a
user reads; what to do about it (``trainer.nonfinite``: fail or skip) is the trainer's business, and
:class:`NonFiniteError` is how it stops a run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch


class NonFiniteError(ArithmeticError):
    """A reward, advantage, loss or gradient norm is NaN or infinite; the message is one line naming the
    step, the stage and the samples or values at fault."""


def nonfinite_rows(values: torch.Tensor) -> list[tuple[int, float]]:
    """``(row, its first non-finite value)`` for every row of ``values`` ([N, ...]) holding a NaN or an
    infinity, in row order."""
    flat = values.detach().reshape(values.shape[0], -1)
    bad = ~torch.isfinite(flat)
    rows = bad.any(dim=1).nonzero().flatten()
    first = bad[rows].int().argmax(dim=1)  # argmax of 0/1 flags: the first set one
    return [(int(row), float(flat[row, column])) for row, column in zip(rows.tolist(), first.tolist())]


def describe_rows(
    what: str, found: list[tuple[int, float]], total: int, columns: Mapping[str, Sequence], limit: int = 3
) -> str:
    """``non-finite <what> in 2 of 16 samples: row 3 (uid 'a', data_source 'b') = nan; ...``: the rows of
    :func:`nonfinite_rows`, each named by its ``columns`` values, the first ``limit`` of them spelled out."""
    named = []
    for row, value in found[:limit]:
        label = ", ".join(f"{name} {values[row]!r}" for name, values in columns.items())
        named.append(f"row {row} ({label}) = {value}" if label else f"row {row} = {value}")
    more = f"; and {len(found) - limit} more" if len(found) > limit else ""
    return f"non-finite {what} in {len(found)} of {total} samples: {'; '.join(named)}{more}"


def nonfinite_values(values: Mapping[str, float]) -> dict[str, float]:
    """The entries of ``values`` that are NaN or infinite."""
    return {name: value for name, value in values.items() if not math.isfinite(value)}


def describe_values(values: Mapping[str, float]) -> str:
    """``actor/pg_loss = nan, actor/grad_norm = inf``: the non-finite entries of ``values``."""
    return ", ".join(f"{name} = {value}" for name, value in nonfinite_values(values).items())
