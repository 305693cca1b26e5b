"""Validation metrics over the ``val_kwargs.n`` responses of each prompt: verl's definitions and names, and pass@k.

Per data source, prompt and variable (``reward``: the sequence score, and each number its scorer reports beside it,
e.g. ``acc``): ``mean@N``, ``std@N`` over the prompt's N responses and, for n = 2, 4, ... < N and N, bootstrap
estimates ``best@n/{mean,std}``, ``worst@n/{mean,std}`` and, where the scorer reports a ``pred`` (its extracted
answer), ``maj@n/{mean,std}``: 1000 draws of n responses with replacement from seed 42, the same draws for every
prompt, as verl's ``process_validation_metrics`` draws them (so the numbers are verl's). Each is averaged over the
prompts. ``val-core/`` holds the core variable's (``acc`` if reported, else ``reward``) mean, best and maj at N, as
verl's ``_validate``; ``val-aux/`` the rest, with the unbiased pass@k (Chen et al. 2021) of the core variable.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from ppoflow.algorithms.scoring import PRED

SEED = 42
N_BOOTSTRAP = 1000
PASSED = 1.0
"""A response passes (pass@k) when its core value is at least this: full credit (verl's ``acc`` is 1 or 0)."""
CORE_PREFIXES = ("mean", "best", "maj")
CORE_MEAN = re.compile(r"^val-core/.+/(reward|acc)/mean@\d+$")
"""The headline validation metric of a data source: the mean of its core variable (``acc`` if its scorer
reports one, else ``reward``) over all N samples, as the reward curve and the progress bar show it."""


def bootstrap_sizes(n: int) -> list[int]:
    """verl's bootstrap subset sizes for ``n`` responses: 2, 4, 8, ... below ``n``, then ``n`` (none for n <= 1)."""
    sizes, size = [], 2
    while size < n:
        sizes.append(size)
        size *= 2
    return sizes + [n] if n > 1 else []


def pass_ks(n: int) -> list[int]:
    """The k of pass@k for ``n`` responses: 1, 2, 4, ... up to ``n``."""
    return [2**power for power in range(n.bit_length())] if n > 0 else []


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k, ``1 - C(n-c, k) / C(n, k)``: the chance that k of the ``n`` responses,
    drawn without replacement, include one of the ``c`` that pass."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@lru_cache(maxsize=64)
def bootstrap_draws(n: int, size: int, seed: int = SEED, n_bootstrap: int = N_BOOTSTRAP) -> np.ndarray:
    """[n_bootstrap, size] response indices drawn with replacement, as ``np.random.seed(seed)`` then
    ``np.random.choice(n, (n_bootstrap, size))`` draws them (verl's ``bootstrap_metric``); read-only."""
    draws = np.random.RandomState(seed).choice(n, size=(n_bootstrap, size), replace=True)
    draws.flags.writeable = False
    return draws


def majority_values(values: np.ndarray, votes: np.ndarray) -> np.ndarray:
    """Per row of ``votes`` [B, n] (answers as codes), the value in ``values`` [B, n] of the first response giving
    the most frequent answer, ties going to the answer given first (verl's ``calc_maj_val``)."""
    rows, answers = np.arange(len(votes))[:, None], int(votes.max()) + 1
    per_answer = np.bincount((votes + answers * rows).ravel(), minlength=len(votes) * answers)
    counts = per_answer.reshape(len(votes), answers)[rows, votes]  # how often each response's answer was given
    return values[rows[:, 0], counts.argmax(axis=1)]


def prompt_metrics(
    values: Sequence[float], preds: Sequence | None = None, *, seed: int = SEED, n_bootstrap: int = N_BOOTSTRAP
) -> dict[str, float]:
    """One prompt's metrics of one variable: ``mean@N``, ``std@N`` (population) and the bootstrap estimates at each
    of :func:`bootstrap_sizes` - ``maj@n`` only given ``preds``, the answer of each response."""
    array = np.asarray(values, dtype=np.float64)
    n = len(array)
    metrics = {f"mean@{n}": float(array.mean())}
    if n > 1:
        metrics[f"std@{n}"] = float(array.std())
    codes: dict = {}
    votes = None if preds is None else np.array([codes.setdefault(pred, len(codes)) for pred in preds])
    for size in bootstrap_sizes(n):
        draws = bootstrap_draws(n, size, seed, n_bootstrap)
        drawn = array[draws]
        per_draw = {"best": drawn.max(axis=1), "worst": drawn.min(axis=1)}
        if votes is not None:
            per_draw["maj"] = majority_values(drawn, votes[draws])
        for name, results in per_draw.items():
            metrics[f"{name}@{size}/mean"] = float(results.mean())
            metrics[f"{name}@{size}/std"] = float(results.std())
    return metrics


def validation_metrics(
    data_sources: Sequence[str],
    uids: Sequence,
    variables: dict[str, Sequence],
    *,
    seed: int = SEED,
    n_bootstrap: int = N_BOOTSTRAP,
) -> dict[str, float]:
    """``val-core/`` and ``val-aux/{data_source}/{variable}/{metric}`` of responses given as parallel lists: each
    one's data source, its prompt's uid and its value of each variable; ``variables["pred"]``, when there, holds
    the answers majority voting counts (not a variable itself); ``{core}/pass@k`` for k = 1, 2, 4, ... <= N."""
    for name, column in variables.items():
        if len(column) != len(uids):
            raise ValueError(f"validation variable {name!r} has {len(column)} values for {len(uids)} responses")
    preds = variables.get(PRED)
    numbers = {name: column for name, column in variables.items() if name != PRED}
    groups: dict[str, dict] = {}
    for row, (source, uid) in enumerate(zip(data_sources, uids, strict=True)):
        groups.setdefault(source, {}).setdefault(uid, []).append(row)
    core = "acc" if "acc" in numbers else "reward"
    metrics: dict[str, float] = {}
    for source, prompts in groups.items():
        n_max = max(len(rows) for rows in prompts.values())
        for name, column in numbers.items():
            per_prompt = []
            for rows in prompts.values():
                values = [column[row] for row in rows]
                votes = None if preds is None else [preds[row] for row in rows]
                found = prompt_metrics(values, votes, seed=seed, n_bootstrap=n_bootstrap)
                per_prompt.append({**found, **prompt_pass_at_k(values)} if name == core else found)
            for metric, value in _means(per_prompt).items():
                section = "val-core" if name == core and _is_core(metric, n_max) else "val-aux"
                metrics[f"{section}/{source}/{name}/{metric}"] = value
    return metrics


def prompt_pass_at_k(values: Sequence[float]) -> dict[str, float]:
    """``pass@k`` of one prompt's responses, each passing when its value is at least :data:`PASSED`."""
    passed = sum(value >= PASSED for value in values)
    return {f"pass@{k}": pass_at_k(len(values), passed, k) for k in pass_ks(len(values))}


def _means(per_prompt: list[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the prompts that have it."""
    collected: dict[str, list[float]] = {}
    for found in per_prompt:
        for metric, value in found.items():
            collected.setdefault(metric, []).append(value)
    return {metric: float(np.mean(values)) for metric, values in collected.items()}


def _is_core(metric: str, n_max: int) -> bool:
    """verl's ``val-core``: the mean, best and maj metrics at the most responses a prompt had."""
    kind, _, rest = metric.partition("@")
    return kind in CORE_PREFIXES and rest.split("/")[0] == str(n_max)
