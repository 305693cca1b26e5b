"""verl's policy losses by ``loss_mode`` name (``actor_rollout_ref.actor.policy_loss.loss_mode``), and the registry.

Every registered loss takes ``(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, config,
rollout_is_weights=None, generator=None, **normalizers)``: ``[batch, response_len]`` tensors, the actor's config
section (``clip_ratio_low``, ``tau_pos``, ``policy_loss.*``, ...), detached rollout-correction weights that
multiply the per-token loss, a torch generator for a loss that samples (clip_cov), and :func:`agg_loss`'s
normalisers. It returns ``(loss, metrics)``, the metrics detached scalar tensors under plain names
(``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``). A user's loss registers with
:func:`register_policy_loss`. Deviations from verl: docs/architecture.md#the-algorithms-and-where-they-differ-from-verl.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ppoflow.algorithms.losses import agg_loss
from ppoflow.algorithms.masked import masked_mean

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}
"""Every registered loss by name: the built-in ones (:data:`~ppoflow.algorithms.names.POLICY_LOSSES`) first."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make the function the loss ``loss_mode=name`` selects (again: a file imported twice replaces it)."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return register


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered as ``name``, or ``ValueError`` naming the registered ones."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"{name!r} is not a policy loss; registered: {', '.join(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _metrics(**values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: value.detach() for name, value in values.items()}


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
    """verl's ``vanilla`` PPO clipped policy loss with clip-higher and dual clip (:func:`vanilla` reads its
    bounds from the config).

    With ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``: ``L_clip = max(-A * r, -A * clip(r, 1 -
    clip_ratio_low, 1 + clip_ratio_high))``; where ``A < 0`` the loss is further capped at ``-A * clip_ratio_c``
    (dual clip). Metrics (masked means): ``pg_clipfrac`` (the clipped term is the larger), ``ppo_kl`` (of the
    clamped ``old_log_prob - log_prob``), ``pg_clipfrac_lower`` (the dual-clip cap is active, A < 0).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip PPO lower bound) must be > 1.0, got {clip_ratio_c}.")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    normalizers = {"num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale_factor": loss_scale_factor}
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **normalizers)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((clipped > unclipped).to(mask.dtype), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
        pg_clipfrac_lower=masked_mean(((clip_loss > dual_cap) & negative).to(mask.dtype), mask),
    )


@register_policy_loss("vanilla")
def vanilla(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """:func:`compute_policy_loss` with the config's ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``."""
    return compute_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        rollout_is_weights=rollout_is_weights,
        **normalizers,
    )


@register_policy_loss("gspo")
def gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """GSPO (arXiv:2507.18071): the sequence ratio ``s_i = exp(mean_t log r_it)`` clipped to ``[1 -
    clip_ratio_low, 1 + clip_ratio_high]``, each token carrying ``sg[s_i] * pi / sg[pi]`` (log clamped at 10), so
    the gradient of sequence ``i`` is ``s_i * A`` spread over its tokens. Always ``seq-mean-token-mean`` (verl)."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, "seq-mean-token-mean", **normalizers)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((clipped > unclipped).to(mask.dtype), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
        pg_clipfrac_lower=torch.zeros((), device=pg_loss.device),
    )


@register_policy_loss("cispo")
def cispo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """CISPO (arXiv:2506.13585): ``-sg[clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A * log_prob``, so a
    clipped token keeps its gradient, scaled by the clipped weight. ``pg_clipfrac``: tokens whose ratio is clipped."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    pg_losses = -weight.detach() * advantages * log_prob
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **normalizers)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((ratio != weight).to(mask.dtype), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
        pg_clipfrac_lower=torch.zeros((), device=pg_loss.device),
    )


@register_policy_loss("geo_mean")
def geo_mean(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """GMPO (arXiv:2507.20673): per sequence ``-A_i * exp(mean_t clip_A(log r_it))``, each log-ratio clipped to
    ``[-clip_ratio_low, clip_ratio_high]`` on the side the advantage's sign makes pessimistic, ``A_i`` the masked
    mean advantage; the rollout weights enter as their per-sequence geometric mean. A sequence-level loss: the sum
    over sequences divided by ``num_seqs`` (verl: the micro-batch's mean; ``loss_agg_mode`` unused, as in verl).
    ``pg_clipfrac`` / ``_lower``: tokens whose log-ratio is out of range with A > 0 / A < 0."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -config.clip_ratio_low, config.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * bounded)
    tokens = mask.sum(dim=-1)
    ratio = torch.exp((pessimistic * mask).sum(dim=-1) / (tokens + 1e-8))
    seq_losses = -(advantages * mask).sum(dim=-1) / (tokens + 1e-8) * ratio
    if rollout_is_weights is not None:
        seq_losses = seq_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(-1) / (tokens + 1e-8))
    valid = tokens > 0
    num_seqs = normalizers.get("num_seqs")
    pg_loss = seq_losses[valid].sum() / (valid.sum() if num_seqs is None else num_seqs)
    out_of_range = log_ratio != bounded
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((out_of_range & (advantages > 0)).to(mask.dtype), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
        pg_clipfrac_lower=masked_mean((out_of_range & (advantages < 0)).to(mask.dtype), mask),
    )


@register_policy_loss("sapo")
def sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """SAPO (arXiv:2511.20347): ``-f(r, tau) * A`` with the soft gate ``f = sigmoid(tau * (r - 1)) * 4 / tau``
    instead of a hard clip, ``tau = tau_pos`` where ``A > 0`` else ``tau_neg``. Always ``seq-mean-token-mean``
    (verl); no clipping, so both clip fractions are 0."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    tau = torch.full_like(advantages, config.tau_neg).masked_fill(advantages > 0, config.tau_pos)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    pg_loss = agg_loss(_weighted(-gate * advantages, rollout_is_weights), mask, "seq-mean-token-mean", **normalizers)
    zero = torch.zeros((), device=pg_loss.device)
    return pg_loss, _metrics(pg_clipfrac=zero, ppo_kl=masked_mean(-log_ratio, mask), pg_clipfrac_lower=zero)


def _centred_products(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Clip-Cov's and KL-Cov's per-token covariance term ``(A - mean A) * (log_prob - mean log_prob)``, the means
    over the micro-batch's valid tokens (detached: it only selects tokens)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


@register_policy_loss("clip_cov")
def clip_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """Clip-Cov (arXiv:2505.22617): the PPO clip (no dual clip), with the gradient of ``max(1, int(clip_cov_ratio *
    tokens))`` tokens cut: drawn (with ``generator``) from those the clip left alone whose covariance term lies in
    ``(clip_cov_lb, clip_cov_ub)``. ``pg_clipfrac``: the cut tokens' share."""
    mask = response_mask.to(log_prob.dtype)
    settings = config.policy_loss
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    cov = _centred_products(advantages, log_prob, mask)
    candidates = (mask > 0) & ~(clipped > unclipped) & (cov > settings.clip_cov_lb) & (cov < settings.clip_cov_ub)
    chosen = torch.nonzero(candidates)
    cut_count = max(int(settings.clip_cov_ratio * float(mask.sum())), 1)
    chosen = chosen[torch.randperm(len(chosen), generator=generator)[:cut_count].to(chosen.device)]
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    pg_losses = torch.maximum(unclipped, clipped) * keep
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **normalizers)
    return pg_loss, _metrics(
        pg_clipfrac=masked_mean((keep == 0).to(mask.dtype), mask), ppo_kl=masked_mean(-log_ratio, mask)
    )


@register_policy_loss("kl_cov")
def kl_cov(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    *,
    loss_agg_mode,
    config,
    rollout_is_weights=None,
    generator=None,
    **normalizers,
):
    """KL-Cov (arXiv:2505.22617): the unclipped ``-A * r``, plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * tokens))`` valid tokens of largest covariance term. ``ppo_kl``: the mean ``|log r|``
    (verl's)."""
    mask = response_mask.to(log_prob.dtype)
    settings = config.policy_loss
    log_ratio = log_prob - old_log_prob
    pg_losses = -advantages * torch.exp(log_ratio)
    valid = torch.nonzero(mask.reshape(-1) > 0).squeeze(-1)
    cov = _centred_products(advantages, log_prob, mask).reshape(-1)[valid]
    if len(valid):
        largest = valid[torch.topk(cov, max(1, int(len(valid) * settings.kl_cov_ratio))).indices]
        penalty = torch.zeros(mask.numel(), dtype=pg_losses.dtype, device=pg_losses.device)
        penalty[largest] = settings.ppo_kl_coef
        pg_losses = pg_losses + penalty.reshape(mask.shape) * log_ratio.abs()
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **normalizers)
    return pg_loss, _metrics(ppo_kl=masked_mean(log_ratio.abs(), mask))
