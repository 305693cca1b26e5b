"""Statistics over the valid (masked) tokens of ``[batch, response_len]`` tensors, with verl's arithmetic
(``verl.utils.torch_functional``): a masked mean divides by ``mask.sum() + 1e-8`` and whitening uses
``rsqrt(var + 1e-8)`` with the unbiased variance. Advantages, losses, KL and rollout correction all
reduce over response tokens with these.
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the elements where ``mask`` is set.

    ``values`` and ``mask`` share a shape; the result is reduced over ``dim`` (all dims when None).
    The denominator is ``mask.sum(dim) + 1e-8``, so an empty mask gives 0 rather than NaN.  Values
    outside the mask are ignored even when they are NaN or inf.
    """
    mask = mask.to(values.dtype)
    total = torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim=dim)
    return total / (mask.sum(dim=dim) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance (a scalar tensor) of ``values`` over all masked elements.

    With ``unbiased`` the Bessel factor ``n / (n - 1)`` is applied, where ``n`` is the number of masked
    elements; ``n`` of 0 or 1 then raises ``ValueError`` (as in verl).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        if count == 0:
            raise ValueError("masked_var: the mask selects no element.")
        if count == 1:
            raise ValueError("masked_var: the mask selects a single element; the unbiased variance is undefined.")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` with the mean and unbiased variance of its masked elements.

    Returns a tensor shaped like ``values``: ``(values - mean) * rsqrt(var + 1e-8)``, plus ``mean`` again
    when ``shift_mean`` is False.  Every element is transformed, masked or not.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
