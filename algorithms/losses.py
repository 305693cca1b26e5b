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


CHUNK_ELEMENTS = 2**24
"""Logit entries a chunk of tokens holds in :func:`log_probs_and_entropy`'s temporaries (64 MiB of float32)."""


def log_probs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each label's log-probability and (``with_entropy``) the entropy of each ``[K, vocab]`` logit row, in float32
    (or float64 for float64 logits):
    ``log softmax(z)[label]`` and ``H = -sum(softmax(z) * log softmax(z))``.

    One pass over chunks of tokens that keeps only the logits for the backward pass, which recomputes each chunk's
    softmax: the separate log-softmax and softmax would each keep another ``[K, vocab]`` tensor."""
    log_probs, entropy = _LogProbsAndEntropy.apply(logits, labels, with_entropy)
    return log_probs, entropy if with_entropy else None


class _LogProbsAndEntropy(torch.autograd.Function):
    """Gradients: ``d log p_t / d z_i = [i = t] - p_i`` and ``d H / d z_i = -p_i (log p_i + H)``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
        dtype = torch.promote_types(logits.dtype, torch.float32)
        log_probs = logits.new_empty(logits.shape[0], dtype=dtype)
        entropy = torch.zeros_like(log_probs)
        normalizers = torch.empty_like(log_probs)
        for rows in _chunks(logits):
            chunk = logits[rows].to(dtype)
            normalizers[rows] = torch.logsumexp(chunk, dim=-1)
            log_probs[rows] = chunk.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - normalizers[rows]
            if with_entropy:
                entropy[rows] = normalizers[rows] - (torch.softmax(chunk, dim=-1) * chunk).sum(dim=-1)
        ctx.save_for_backward(logits, labels, normalizers, entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, labels, normalizers, entropy = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(logits):
            token_log_probs = logits[rows].to(normalizers.dtype) - normalizers[rows].unsqueeze(-1)
            probs = token_log_probs.exp()
            grad = torch.zeros_like(probs)
            if grad_log_probs is not None:
                grad -= probs * grad_log_probs[rows].unsqueeze(-1)
                grad.scatter_add_(-1, labels[rows].unsqueeze(-1), grad_log_probs[rows].unsqueeze(-1))
            if grad_entropy is not None:
                grad -= probs * (token_log_probs + entropy[rows].unsqueeze(-1)) * grad_entropy[rows].unsqueeze(-1)
            grad_logits[rows] = grad.to(logits.dtype)
        return grad_logits, None, None


def _chunks(logits: torch.Tensor) -> list[slice]:
    """Slices of ``logits``' rows of at most :data:`CHUNK_ELEMENTS` entries each."""
    size = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    return [slice(start, start + size) for start in range(0, logits.shape[0], size)]
