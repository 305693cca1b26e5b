"""What the actor and critic workers share: building model inputs from a step batch, walking
mini- and micro-batches, and one optimizer step with gradient clipping.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from tensordict import TensorDict

from configs.schema import OptimConfig


def sequence_inputs(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` of prompt + response, [N, P + R].

    Prompts are left-padded, so positions count real tokens only (the same positions the
    generation engine used); the response part is right-padded and masked after EOS.
    """
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def response_logits(model, batch: TensorDict) -> torch.Tensor:
    """Logits that predict each response token, [N, R, vocab] (positions P-1 ... P+R-2)."""
    input_ids, attention_mask, position_ids = sequence_inputs(batch)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    prompt_length, response_length = batch["prompts"].shape[1], batch["responses"].shape[1]
    return logits[:, prompt_length - 1: prompt_length + response_length - 1]


def micro_batches(batch: TensorDict, size: int | None) -> Iterator[TensorDict]:
    """Consecutive slices of at most ``size`` rows (all rows when ``size`` is None)."""
    size = size or batch.batch_size[0]
    for start in range(0, batch.batch_size[0], size):
        yield batch[start:start + size]


def mini_batches(batch: TensorDict, size: int, *, shuffle: bool, generator: torch.Generator) -> Iterator[TensorDict]:
    """The batch split into mini-batches of ``size`` rows, optionally in a shuffled order."""
    order = torch.randperm(batch.batch_size[0], generator=generator) if shuffle else torch.arange(batch.batch_size[0])
    for start in range(0, len(order), size):
        yield batch[order[start:start + size]]


def make_optimizer(model: torch.nn.Module, optim: OptimConfig):
    """AdamW with a linear warm-up to ``optim.lr`` over ``optim.lr_warmup_steps`` updates."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)
    warmup = optim.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: min(1.0, (update + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def clipped_step(model: torch.nn.Module, optimizer, scheduler, grad_clip: float) -> float:
    """Clip gradients, then step; a non-finite gradient norm skips the step (as verl does)."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the mini-batches that reported it."""
    names = {name for row in rows for name in row}
    return {name: sum(row[name] for row in rows if name in row) / sum(name in row for row in rows) for name in sorted(names)}
