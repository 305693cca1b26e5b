"""Rollout correction: importance-sampling weights and rejection masks for off-policy rollouts.

The rollout engine samples with ``rollout_log_prob`` while the trainer recomputes ``old_log_prob``; following verl's
``rollout_corr_helper``, :func:`compute_rollout_is_weights` turns ``log r = old_log_prob - rollout_log_prob`` into
detached IS weights on the PPO loss (per token or per sequence; TIS truncation or IcePop zeroing), and
:func:`compute_rejection_mask` zeroes the ``response_mask`` of tokens or sequences out of bounds. Metrics are
under ``rollout_corr/``. Details and deviations from verl:
docs/architecture.md#the-algorithms-and-where-they-differ-from-verl.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ppoflow.algorithms.masked import masked_mean
from ppoflow.algorithms.names import IS_LEVELS

_SAFETY_BOUND = 20.0
_PREFIX = "rollout_corr/"
REJECTION_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def parse_is_threshold(value: float | int | str) -> tuple[float | None, float]:
    """Parse an IS / rejection threshold into ``(lower, upper)``.

    A number or numeric string gives ``(None, upper)`` (truncation); a string ``"lo_hi"`` (e.g.
    ``"0.5_2.0"``) gives ``(lo, hi)`` (IcePop bounds).  Bools and other types raise ``TypeError``;
    unparsable strings, NaN bounds, bounds <= 0 and ``lo > hi`` raise ``ValueError`` naming the value.
    """
    if isinstance(value, bool):
        raise TypeError(f"Threshold must be a number or a string, not a bool ({value!r}).")
    if isinstance(value, int | float):
        lower, upper = None, float(value)
    elif isinstance(value, str):
        spec = value.strip()
        try:
            if "_" in spec:
                lower_text, upper_text = spec.split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                lower, upper = None, float(spec)
        except ValueError as exc:
            raise ValueError(f"Invalid threshold {value!r}: expected a number or 'lower_upper'.") from exc
    else:
        raise TypeError(f"Threshold must be a number or a string, got {type(value).__name__} ({value!r}).")
    if math.isnan(upper) or (lower is not None and math.isnan(lower)):
        raise ValueError(f"Invalid threshold {value!r}: a bound is NaN.")
    if upper <= 0:
        raise ValueError(f"Invalid threshold {value!r}: the upper bound must be > 0.")
    if lower is not None:
        if lower <= 0:
            raise ValueError(f"Invalid threshold {value!r}: the lower bound must be > 0.")
        if lower > upper:
            raise ValueError(f"Invalid threshold {value!r}: the lower bound exceeds the upper bound.")
    return lower, upper


def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str,
    threshold: float | int | str,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights pi_train / pi_rollout; tensors ``[batch, response_len]``, weights the same shape.

    ``level="token"``: ``w_t = exp(clamp(log r_t, -20, 20))``.  ``level="sequence"``:
    ``exp(clamp(sum_t mask * log r_t, -20, 20))`` broadcast to every token of the sequence.  Weights
    are multiplied by the mask, then clamped to ``upper`` (TIS, a single-number ``threshold``) or set
    to 0 outside ``[lo, hi]`` (IcePop, a ``"lo_hi"`` threshold), and detached.  With
    ``batch_normalize`` they are divided by their mean: over valid tokens for ``token``, over the
    per-sequence weights of sequences with a valid token for ``sequence`` (skipped if the mean is
    <= 1e-8).

    Metrics (pre-normalisation weights): ``rollout_corr/rollout_is_mean`` (masked mean), ``..._max``
    and ``..._min`` (over valid tokens), ``rollout_corr/rollout_is_frac_truncated`` (TIS: valid tokens
    whose raw weight exceeded ``upper``) or ``rollout_corr/rollout_is_frac_zeroed`` (IcePop: valid tokens
    zeroed), and ``rollout_corr/rollout_is_batch_norm_factor`` when normalising.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"Unknown rollout IS level {level!r}; expected one of {', '.join(IS_LEVELS)}.")
    lower, upper = parse_is_threshold(threshold)
    mask = response_mask.to(old_log_prob.dtype)
    valid = mask.bool()
    if not valid.any():
        raise ValueError("compute_rollout_is_weights: response_mask has no valid token.")

    with torch.no_grad():
        log_ratio = old_log_prob - rollout_log_prob
        if level == "sequence":
            log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1, keepdim=True)
        raw = torch.exp(torch.clamp(log_ratio, -_SAFETY_BOUND, _SAFETY_BOUND)).expand_as(mask) * mask

        metrics: dict[str, float] = {}
        if lower is None:
            weights = raw.clamp(max=upper)
            metrics[_PREFIX + "rollout_is_frac_truncated"] = masked_mean((raw > upper).to(mask.dtype), mask).item()
        else:
            outside = (raw < lower) | (raw > upper)
            weights = torch.where(outside, torch.zeros_like(raw), raw)
            metrics[_PREFIX + "rollout_is_frac_zeroed"] = masked_mean(outside.to(mask.dtype), mask).item()
        metrics[_PREFIX + "rollout_is_mean"] = masked_mean(weights, mask).item()
        metrics[_PREFIX + "rollout_is_max"] = weights[valid].max().item()
        metrics[_PREFIX + "rollout_is_min"] = weights[valid].min().item()

        if batch_normalize:
            if level == "token":
                mean = masked_mean(weights, mask)
            else:
                seq_valid = mask.sum(dim=-1) > 0
                mean = masked_mean(masked_mean(weights, mask, dim=-1), seq_valid)
            if mean > 1e-8:
                weights = weights / mean
                metrics[_PREFIX + "rollout_is_batch_norm_factor"] = mean.item()
            else:
                metrics[_PREFIX + "rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _parse_rejection_thresholds(
    options: list[str], thresholds: float | int | str | Sequence[float | int | str]
) -> list[tuple[float | None, float]]:
    """One ``(lower, upper)`` pair per option; lower is None for k2/k3 and always set for k1."""
    if isinstance(thresholds, str):
        specs: list[float | int | str] = [part.strip() for part in thresholds.split(",") if part.strip()]
    elif isinstance(thresholds, Sequence):
        specs = list(thresholds)
    else:
        specs = [thresholds]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout rejection: got {len(specs)} thresholds for {len(options)} options {options}; "
            "give one per option or a single one."
        )
    if len(specs) == 1:
        specs = specs * len(options)
    parsed = []
    for option, spec in zip(options, specs):
        lower, upper = parse_is_threshold(spec)
        if option.endswith("k1"):
            if lower is None and upper < 1:  # [1/u, u] would be empty: every token rejected
                raise ValueError(
                    f"rollout rejection option {option!r}: a single ratio bound {spec!r} means "
                    f"[1/{spec}, {spec}], which needs a bound >= 1; give 'lower_upper' otherwise."
                )
            parsed.append((1.0 / upper if lower is None else lower, upper))
        elif lower is not None:
            raise ValueError(f"rollout rejection option {option!r} takes a single upper bound, got {spec!r}.")
        else:
            parsed.append((None, upper))
    return parsed


def compute_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    options: str,
    thresholds: float | int | str | Sequence[float | int | str],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reject tokens or sequences whose train/rollout divergence is out of bounds; tensors ``[batch, response_len]``.

    With ``log r = clamp(old_log_prob - rollout_log_prob, -20, 20)`` the per-token estimators are
    ``k1 = -log r``, ``k2 = (log r)^2 / 2`` and ``k3 = exp(log r) - 1 - log r``.  Each option in the
    comma list ``options`` aggregates one of them per token (``token_*``) or per sequence over valid
    tokens (``seq_sum_*``, ``seq_mean_*``, ``seq_max_*``; a sequence statistic applies to all its tokens).

    ``thresholds`` gives one spec per option (comma string or list) or a single spec for all.  k2/k3
    options keep ``stat <= upper``.  k1 options take ``"lo_hi"`` (a bare ``u`` means ``[1/u, u]``, as in
    verl) and keep ``log(lo) <= stat <= log(hi)``; since ``k1 = log(pi_rollout / pi_train)``, for
    ``token_k1`` this keeps ``lo <= pi_rollout / pi_train <= hi``.

    Every option must pass (AND).  Returns ``response_mask * keep`` in the mask's dtype and the metrics
    ``rollout_corr/rollout_rs_masked_fraction`` (valid tokens rejected) and
    ``rollout_corr/rollout_rs_<option>_masked_fraction`` per option.
    """
    names = list(dict.fromkeys(part.strip() for part in options.split(",") if part.strip()))
    if not names:
        raise ValueError(f"rollout rejection: no option in {options!r}; known: {', '.join(REJECTION_OPTIONS)}.")
    for name in names:
        if name not in REJECTION_OPTIONS:
            raise ValueError(f"Unknown rollout rejection option {name!r}; known: {', '.join(REJECTION_OPTIONS)}.")
    bounds = _parse_rejection_thresholds(names, thresholds)

    mask = response_mask.to(old_log_prob.dtype)
    valid = mask.bool()
    with torch.no_grad():
        log_ratio = torch.clamp(old_log_prob - rollout_log_prob, -_SAFETY_BOUND, _SAFETY_BOUND)
        estimators = {
            "k1": -log_ratio,
            "k2": 0.5 * log_ratio.square(),
            "k3": torch.exp(log_ratio) - 1.0 - log_ratio,
        }
        keep = torch.ones_like(valid)
        metrics: dict[str, float] = {}
        for name, (lower, upper) in zip(names, bounds):
            aggregation, estimator = name.rsplit("_", 1)
            per_token = estimators[estimator]
            if aggregation == "token":
                stat = per_token
            elif aggregation == "seq_sum":
                stat = torch.where(valid, per_token, torch.zeros_like(per_token)).sum(dim=-1, keepdim=True)
            elif aggregation == "seq_mean":
                stat = masked_mean(per_token, mask, dim=-1).unsqueeze(-1)
            else:  # seq_max; a sequence without valid tokens gets 0
                stat = per_token.masked_fill(~valid, float("-inf")).max(dim=-1, keepdim=True).values
                stat = torch.where(stat == float("-inf"), torch.zeros_like(stat), stat)
            if lower is None:
                option_keep = stat <= upper
            else:
                option_keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
            option_keep = option_keep.expand_as(valid)
            metrics[f"{_PREFIX}rollout_rs_{name}_masked_fraction"] = masked_mean(
                (~option_keep).to(mask.dtype), mask
            ).item()
            keep = keep & option_keep
        metrics[_PREFIX + "rollout_rs_masked_fraction"] = masked_mean((~keep).to(mask.dtype), mask).item()
    return (mask * keep.to(mask.dtype)).to(response_mask.dtype), metrics


def correct_off_policy(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_rs: str | None,
    rollout_rs_threshold,
    rollout_is: str | None,
    rollout_is_threshold: float | int | str,
    rollout_is_batch_normalize: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """verl's decoupled correction between the trainer's old log-probs and the rollout's sampling ones.

    Returns the response mask with rejected tokens or sequences zeroed (``rollout_rs``), the IS weights
    (``rollout_is``; None when off) and the metrics: how far the two policies are apart
    (``training/rollout_probs_diff_max`` / ``_mean``, verl's names, over valid tokens) and the
    ``rollout_corr/*`` metrics of what was applied.
    """
    valid = response_mask.bool()
    gap = (old_log_probs.exp() - rollout_log_probs.exp()).abs()[valid]
    metrics = {
        "training/rollout_probs_diff_max": float(gap.max()),
        "training/rollout_probs_diff_mean": float(gap.mean()),
    }
    if rollout_rs:
        response_mask, rejected = compute_rejection_mask(
            old_log_probs, rollout_log_probs, response_mask, options=rollout_rs, thresholds=rollout_rs_threshold
        )
        metrics.update(rejected)
    weights = None
    if rollout_is:
        weights, weighted = compute_rollout_is_weights(
            old_log_probs,
            rollout_log_probs,
            response_mask,
            level=rollout_is,
            threshold=rollout_is_threshold,
            batch_normalize=rollout_is_batch_normalize,
        )
        metrics.update(weighted)
    return response_mask, weights, metrics
