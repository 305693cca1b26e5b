"""DAPO's two reward-side pieces, as pure functions (Yu et al. 2025; verl's ``recipe/dapo``).

Dynamic sampling (``algorithm.filter_groups``): a prompt group whose metric is the same for every response
carries no GRPO signal (its advantages are all zero), so it is dropped; :func:`kept_groups` says which
stay. The overlong buffer (``reward_model.reward_kwargs.overlong_buffer_cfg``): a response that enters the
last ``len`` tokens of the length budget loses up to ``penalty_factor`` (:func:`overlong_penalty`).
"""

from __future__ import annotations

import torch


def kept_groups(uids: list[str], values: list[float]) -> list[str]:
    """The uids, in first-seen order, whose group's ``values`` are not all equal (verl: ``std > 0``), or
    that have a single response (verl keeps those too)."""
    groups: dict[str, list[float]] = {}
    for uid, value in zip(uids, values, strict=True):
        groups.setdefault(uid, []).append(float(value))
    return [uid for uid, group in groups.items() if len(group) == 1 or max(group) != min(group)]


def overlong_penalty(
    response_lengths: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """verl's DAPO reward manager: ``min(-(L - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0)``
    per response of ``L`` tokens: 0 up to ``max_resp_len - buffer_len``, then down linearly to
    ``-penalty_factor`` at ``max_resp_len``."""
    exceed = response_lengths.to(torch.float32) - (max_resp_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
