"""Loss aggregation, the PPO value loss, and logit helpers, with verl's semantics.

All per-token tensors are ``[batch, response_len]``. :func:`agg_loss` reduces a per-token loss matrix to a scalar
with the normalisers (``num_tokens``/``num_seqs``) of the whole mini-batch, so that its micro-batches' losses,
summed, equal the mini-batch's; the caller composes the entropy bonus with the same mode and normalisers.
:func:`compute_value_loss` is verl's clipped value loss; the policy losses are in
:mod:`ppoflow.algorithms.policy_losses`. Deviations from verl:
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
