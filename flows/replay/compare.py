"""Comparing a replay's per-step metrics with a baseline's: pure functions, no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_IGNORED = ("timing_s/", "perf/", "skip/", "training/off_policy/")
"""Metric name prefixes never compared: timings vary; cache hit flags differ by design between record and
replay; staleness is not reported for replayed batches."""

MISSING = "missing"
"""The ``baseline`` or ``value`` of a mismatch row for a metric (or step) one side does not have."""


class ReplayMismatch(Exception):
    """The replayed metrics differ from the baseline; ``mismatches`` holds :func:`compare`'s rows."""

    def __init__(self, message: str, mismatches: list[dict]):
        super().__init__(message, mismatches)
        self.message, self.mismatches = message, mismatches

    def __str__(self) -> str:
        return self.message


def tolerance_for(metric: str, tolerances: Mapping[str, float]) -> float:
    """``metric``'s tolerance: its exact name, else the longest prefix key ending in ``/``, else 0 (exact)."""
    if metric in tolerances:
        return float(tolerances[metric])
    prefixes = [key for key in tolerances if key.endswith("/") and metric.startswith(key)]
    return float(tolerances[max(prefixes, key=len)]) if prefixes else 0.0


def compare(
    baseline_rows: Sequence[Mapping],
    rows: Sequence[Mapping],
    tolerances: Mapping[str, float] | None = None,
    *,
    ignored: Sequence[str] = DEFAULT_IGNORED,
) -> list[dict]:
    """Mismatches of ``rows`` against ``baseline_rows`` (both ``read_metrics`` rows, keyed by ``step``).

    For every step of the baseline and every metric of either side not under an ``ignored`` prefix, the
    absolute difference must be at most the metric's tolerance (see :func:`tolerance_for`). A metric or a
    step that one side lacks is a mismatch (its side reads ``"missing"``), and so is a non-finite value
    (``None``) facing a finite one. Returns ``{"step", "metric", "baseline", "value", "difference"}``
    rows, by step and metric; empty when everything matches.
    """
    tolerances = dict(tolerances or {})
    for key, tolerance in tolerances.items():
        if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
            raise ValueError(f"tolerance of {key!r} must be a number >= 0, got {tolerance!r}")
    replayed = {row["step"]: row for row in rows}
    mismatches = []
    for expected in sorted({row["step"]: row for row in baseline_rows}.values(), key=lambda row: row["step"]):
        step = expected["step"]
        actual = replayed.get(step, {})
        names = {name for name in (*expected, *actual) if name != "step" and not name.startswith(tuple(ignored))}
        for name in sorted(names):
            before, after = expected.get(name, MISSING), actual.get(name, MISSING)
            difference = _difference(before, after)
            if difference is None or difference > tolerance_for(name, tolerances):
                mismatches.append(
                    {"step": step, "metric": name, "baseline": before, "value": after, "difference": difference}
                )
    return mismatches


def _difference(before: Any, after: Any) -> float | None:
    """``|after - before|`` for two numbers; 0 for equal values; None when they cannot match."""
    if before == after and MISSING not in (before, after):
        return 0.0
    if _number(before) and _number(after):
        difference = abs(float(after) - float(before))
        return difference if math.isfinite(difference) else None
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
