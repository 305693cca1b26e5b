"""Loss aggregation, the PPO policy and value losses, and logit helpers, with verl's semantics.

All per-token tensors are ``[batch, response_len]``. :func:`agg_loss` reduces a per-token loss matrix to a scalar
with the normalisers (``num_tokens``/``num_seqs``) of the whole mini-batch, so that its micro-batches' losses,
summed, equal the mini-batch's; the caller composes the entropy bonus with the same mode and normalisers.
:func:`compute_policy_loss` and :func:`compute_value_loss` are verl's clipped losses. Deviations from verl:
docs/architecture.md#the-algorithms-and-where-they-differ-from-verl.
"""

from __future__ import annotations

import torch

from ppoflow.algorithms.masked import masked_mean
from ppoflow.algorithms.names import LOSS_AGG_MODES


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a ``[batch, response_len]`` loss matrix to a scalar.

    * ``token-mean``: ``sum(mask * L) / num_tokens`` (default: ``mask.sum()``).
    * ``seq-mean-token-sum``: per sequence ``sum_t mask * L``, summed over the sequences that have a
      valid token, divided by ``num_seqs`` (default: the number of such sequences).
    * ``seq-mean-token-mean``: the same with per-sequence ``sum_t mask * L / (n_tokens + 1e-8)``.
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum`` divided by ``loss_scale_factor`` (default: the
      padded horizon ``loss_mask.shape[-1]``), as in Dr.GRPO.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; known modes: {', '.join(LOSS_AGG_MODES)}.")
    mask = loss_mask.to(loss_mat.dtype)
    masked = torch.where(mask.bool(), loss_mat, torch.zeros_like(loss_mat)) * mask
    if loss_agg_mode == "token-mean":
        denominator = mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / denominator
    tokens_per_seq = mask.sum(dim=-1)
    seq_losses = masked.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (tokens_per_seq + 1e-8)
    valid_seq = tokens_per_seq > 0
    denominator = valid_seq.sum() if num_seqs is None else num_seqs
    loss = torch.where(valid_seq, seq_losses, torch.zeros_like(seq_losses)).sum() / denominator
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's ``vanilla`` PPO clipped policy loss with clip-higher and dual clip.

    Tensors are ``[batch, response_len]``.  With ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``:
    ``L_clip = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; where ``A < 0`` the
    loss is further capped at ``-A * clip_ratio_c`` (dual clip).  ``rollout_is_weights`` (detached,
    same shape) multiplies the per-token loss.  The result is aggregated with :func:`agg_loss`.

    Metrics (detached scalar tensors, masked means): ``pg_clipfrac`` (the clipped term is the larger),
    ``ppo_kl`` (mean of the clamped ``old_log_prob - log_prob``) and ``pg_clipfrac_lower`` (the dual-clip
    cap is active, A < 0).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip PPO lower bound) must be > 1.0, got {clip_ratio_c}.")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, mask)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean((clipped > unclipped).to(mask.dtype), mask)

    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    pg_clipfrac_lower = masked_mean(((clip_loss > dual_cap) & negative).to(mask.dtype), mask)

    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(
        pg_losses,
        mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    metrics = {
        "pg_clipfrac": pg_clipfrac.detach(),
        "ppo_kl": ppo_kl.detach(),
        "pg_clipfrac_lower": pg_clipfrac_lower.detach(),
    }
    return pg_loss, metrics


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss; tensors ``[batch, response_len]``, ``values`` are the rollout-time predictions.

    ``vf_loss = 0.5 * agg_loss(max((v - R)^2, (clip(v, values - c, values + c) - R)^2))`` and
    ``vf_clipfrac`` is the masked fraction of tokens where the clipped error is the larger (a detached
    scalar tensor).
    """
    clipped_vpreds = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (clipped_vpreds - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.maximum(unclipped_error, clipped_error),
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac.detach()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution of each ``[..., vocab]`` logit row -> ``[...]``.

    ``H = logsumexp(z) - sum(softmax(z) * z)``, stable for large logits.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label: ``[..., vocab]`` logits and ``[...]`` int64 labels -> ``[...]``."""
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
