"""Advantage estimators for RL post-training, with verl's semantics.

Every estimator takes per-token tensors of shape ``[batch, response_len]`` and returns ``(advantages, returns)``
of the same shape. Outcome estimators (GRPO, RLOO, REINFORCE++-baseline) reduce the token-level rewards to one
score per sequence, compare it with the other samples of the same prompt (same id in ``index``) and broadcast the
result over the response tokens; the masked statistics are :mod:`ppoflow.algorithms.masked`. The known names are
:data:`ADVANTAGE_ESTIMATORS`. Deviations from verl: docs/architecture.md#the-algorithms-and-where-they-differ-from-verl.
"""

from __future__ import annotations

import torch

from ppoflow.algorithms.masked import masked_whiten
from ppoflow.algorithms.names import ADVANTAGE_ESTIMATORS


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation; all tensors ``[batch, response_len]``.

    Backward over t: ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``.
    A masked-out token does not update ``V_next`` nor ``A_next``: both carry through it (and the
    carried ``A_next`` is what that position holds).  ``returns = A + V`` before whitening; the
    advantages are then whitened over the mask (masked positions are transformed too, not zeroed).
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        m = mask[:, t]
        next_value = m * values[:, t] + (1 - m) * next_value
        next_advantage = m * advantage_t + (1 - m) * next_advantage
        advantages[:, t] = next_advantage
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


def _group_mean_std(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample statistics of the sample's group: ``[batch]`` scores, ``[batch]`` ids -> three ``[batch]``.

    Returns (group mean, unbiased group std, group size).  A singleton group gets mean 0 and std 1,
    as in verl.
    """
    _, group = torch.unique(index, return_inverse=True)
    n_groups = int(group.max()) + 1
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, group, torch.ones_like(scores))
    total = zeros.index_add(0, group, scores)
    mean = (total / count)[group]
    squared = zeros.index_add(0, group, (scores - mean) ** 2)
    size = count[group]
    singleton = size == 1
    std = torch.sqrt(squared[group] / torch.where(singleton, torch.ones_like(size), size - 1))
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return mean, std, size


@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage; rewards and mask ``[batch, response_len]``, ``index`` ``[batch]``.

    ``A_i = (s_i - mean_g) / (std_g + epsilon)`` with the unbiased std of the group, or
    ``A_i = s_i - mean_g`` (Dr.GRPO) when ``norm_adv_by_std_in_grpo`` is False.  A singleton group
    uses mean 0 and std 1.  ``A_i`` is broadcast over tokens and multiplied by the mask; the returns
    are the same tensor.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _ = _group_mean_std(scores, index)
    scores = scores - mean
    if norm_adv_by_std_in_grpo:
        scores = scores / (std + epsilon)
    advantages = scores.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (leave-one-out) advantage; rewards and mask ``[batch, response_len]``, ``index`` ``[batch]``.

    For a group of size K > 1, ``A_i = (s_i - mean_g) * K / (K - 1)``, i.e. ``s_i`` minus the mean of
    the other K - 1 samples.  For K = 1 the score is kept unchanged.  Broadcast over tokens times the
    mask; returns equal advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, size = _group_mean_std(scores, index)
    # A singleton group has mean 0 and the factor becomes 1 / 1, which leaves its score unchanged.
    scores = (scores - mean) * size / (size - 1).clamp(min=1)
    advantages = scores.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage; all tensors ``[batch, response_len]``.

    The returns are the discounted return-to-go ``G_t = r_t + gamma * G_{t+1}``, written only on masked
    tokens (0 elsewhere); a masked-out token carries the running return through unchanged.  The
    advantages are ``masked_whiten(G, mask) * mask``.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        candidate = token_level_rewards[:, t] + gamma * running
        m = mask[:, t]
        returns[:, t] = candidate * m
        running = m * candidate + (1 - m) * running
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline advantage; rewards and mask ``[batch, response_len]``, ``index`` ``[batch]``.

    ``s_i - mean_g`` (singleton group: mean 0) is tiled over the tokens, multiplied by the mask, then
    whitened over the whole batch's masked tokens and multiplied by the mask again.  Returns equal
    advantages.  ``epsilon`` is accepted for signature parity with verl, which does not use it either.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = _group_mean_std(scores, index)
    tiled = (scores - mean).unsqueeze(-1) * mask
    advantages = masked_whiten(tiled, mask) * mask
    return advantages, advantages


def compute_advantage(
    estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to the estimator named ``estimator``; returns ``(advantages, returns)`` ``[batch, response_len]``.

    ``values`` (``[batch, response_len]``) is required by ``gae``; ``gamma`` is used by ``gae`` and
    ``reinforce_plus_plus``, ``lam`` by ``gae`` and ``norm_adv_by_std_in_grpo`` by ``grpo``.
    """
    if estimator == "gae":
        if values is None:
            raise ValueError("Advantage estimator 'gae' needs critic values, but values=None.")
        return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)
    if estimator == "grpo":
        return compute_grpo_outcome_advantage(
            token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo
        )
    if estimator == "rloo":
        return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)
    if estimator == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma)
    if estimator == "reinforce_plus_plus_baseline":
        return compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index)
    raise ValueError(f"Unknown advantage estimator {estimator!r}; known estimators: {', '.join(ADVANTAGE_ESTIMATORS)}.")
