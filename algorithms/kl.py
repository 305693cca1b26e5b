"""KL estimators, KL-coefficient controllers and the in-reward KL penalty, with verl's semantics.

The per-token estimators (k1, k2, k3, ``abs``, and the straight-through ``+`` variants) are Schulman's, applied to
``x = log_prob - ref_log_prob``; the controllers (fixed, adaptive) keep the coefficient across a resume through
``state_dict``/``load_state_dict``. The formulas and the deviations from verl:
docs/architecture.md#the-algorithms-and-where-they-differ-from-verl.
"""

from __future__ import annotations

import torch

from ppoflow.algorithms.masked import masked_mean
from ppoflow.algorithms.names import KL_PENALTY_KINDS


def _kl_forward(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Forward value of the base estimator ``kind`` (no ``+``); tensors ``[...]`` -> ``[...]``."""
    if kind in ("kl", "k1"):
        return log_prob - ref_log_prob
    if kind == "abs":
        return (log_prob - ref_log_prob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (log_prob - ref_log_prob).square()
    if kind in ("low_var_kl", "k3"):
        x = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(x) - x - 1, min=-10.0, max=10.0)
    if kind == "full":
        raise NotImplementedError("kl_penalty kind 'full' needs the whole vocabulary distribution; not implemented.")
    raise ValueError(f"Unknown kl_penalty kind {kind!r}; accepted kinds: {', '.join(KL_PENALTY_KINDS)}.")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference; tensors ``[batch, response_len]``.

    ``kind`` is one of :data:`KL_PENALTY_KINDS`.  With a ``+`` suffix the forward value is that of the
    base kind and the gradient is that of k2 (``k2 - k2.detach() + forward.detach()``); ``mse+`` and
    ``k2+`` are plain k2.  ``full`` raises ``NotImplementedError``; any other name ``ValueError``.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    forward = _kl_forward(log_prob, ref_log_prob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + forward.detach()


class FixedKLController:
    """A constant KL coefficient ``value``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Do nothing: the coefficient is fixed."""

    def state_dict(self) -> dict:
        """The coefficient, for checkpointing."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """The adaptive KL coefficient of Ziegler et al. (arXiv 1909.08593), as in verl.

    After each batch, ``value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}.")
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` toward the target KL; ``n_steps`` is the number of sequences in the batch."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """The current coefficient, for checkpointing (target and horizon come from the config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore the coefficient saved by :meth:`state_dict`."""
        self.value = float(state["value"])


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float, horizon: int
) -> FixedKLController | AdaptiveKLController:
    """Build the controller ``kind`` (``fixed`` or ``adaptive``); ``target_kl``/``horizon`` only matter for adaptive."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"Unknown KL controller kind {kind!r}; expected 'fixed' or 'adaptive'.")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str,
) -> tuple[torch.Tensor, float]:
    """Subtract the KL penalty from the scores; tensors ``[batch, response_len]``.

    ``kl = kl_penalty(log_prob, ref_log_prob, kind) * mask`` and ``rewards = scores - kl_coef * kl``.
    The returned ``current_kl`` is verl's ``actor/reward_kl_penalty``: the masked mean of ``kl`` over
    each sequence's tokens, then the plain mean over sequences (an all-masked sequence counts as 0).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_penalty(log_prob, ref_log_prob, kind) * mask
    rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, mask, dim=-1).mean().item()
    return rewards, current_kl
