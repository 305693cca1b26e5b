"""What the actor and critic workers share: the one forward pass over a step batch's responses (padded or packed,
:func:`response_logits`), walking mini- and micro-batches (rows or token budgets, :func:`micro_batches`), and the
optimizer loop of a PPO update (:class:`Learner`), which takes no optimizer step from a non-finite loss or gradient
(``trainer.nonfinite``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict

from ppoflow.algorithms.finite import NonFiniteError, describe_values, nonfinite_values
from ppoflow.configs.schema import FSDPConfig, OptimConfig
from ppoflow.storage.batch import tensors_digest, trim_response_padding
from ppoflow.storage.checkpoint import load_module, save_module
from ppoflow.workers.training.data_parallel import DataParallel, unique_state_names
from ppoflow.workers.training.packing import (
    budget_items,
    pack,
    prompt_groups,
    response_positions,
    sequence_lengths,
    sharing_pays,
    token_budget_parts,
)

logger = logging.getLogger(__name__)


def sequence_inputs(batch: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``input_ids``, the mask of real tokens and ``position_ids`` of prompt + response, [N, P + R].

    Prompts are left-padded, so positions count real tokens only (the same positions the generation engine
    used); a response's tokens are those up to its extent (tool answers included, as the rollout saw them).
    """
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    kept = torch.cat([batch["prompt_mask"].bool(), response_positions(batch)], dim=1)
    position_ids = (kept.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, kept, position_ids


def response_logits(
    model, batch: TensorDict, *, remove_padding: bool = False, compute_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The model's logits (a value head's: its scores) that predict each response token inside its row's extent,
    [K, ...] in row-major order (:func:`~.packing.to_rows` makes them [N, R, ...]). ``remove_padding``: over the
    micro-batch packed without pad tokens (:func:`~.packing.pack`): in one row for flash attention; for sdpa and
    eager in rows of the longest unit, the samples of one prompt behind one copy of it where that costs less
    (:func:`~.packing.sharing_pays`). Else over the padded rows with an attention mask. ``compute_dtype``: under
    ``torch.autocast`` to it (mixed precision at one rank), the logits then in float32."""
    input_ids, kept, position_ids = sequence_inputs(batch)
    prompt_length, positions = batch["prompts"].shape[1], response_positions(batch)
    if remove_padding:
        in_rows = not attention_implementation(model).startswith("flash")  # varlen kernels: one row, no tree masks
        groups = sharing_groups(model, batch, remove_padding)
        if groups is not None and not sharing_pays(kept, prompt_length, groups, attention_pair_weight(model)):
            groups = None
        input_ids, position_ids, index, mask = pack(
            input_ids, kept, position_ids, prompt_length, positions, in_rows=in_rows, groups=groups
        )
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": mask}
        if mask is not None and attention_implementation(model) == "eager":  # eager adds the mask to its scores
            dtype = compute_dtype or next(model.parameters()).dtype
            inputs["attention_mask"] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
    else:
        inputs = {"input_ids": input_ids, "attention_mask": kept.long(), "position_ids": position_ids}
    autocast = torch.autocast(input_ids.device.type, dtype=compute_dtype, enabled=compute_dtype is not None)
    with autocast:
        logits = model(**inputs, use_cache=False).logits
    logits = logits if compute_dtype is None else logits.float()
    if remove_padding:
        return logits.flatten(0, 1)[index]
    return logits[:, prompt_length - 1 : prompt_length + positions.shape[1] - 1][positions]


def sharing_groups(model: torch.nn.Module, batch: TensorDict, remove_padding: bool) -> torch.Tensor | None:
    """The rows' prompt groups (:func:`~.packing.prompt_groups`) when ``model``'s packed passes may lay each group
    behind one copy of its prompt (``remove_padding`` under sdpa or eager attention), else None."""
    if not remove_padding or attention_implementation(model).startswith("flash"):
        return None
    return prompt_groups(batch)


def attention_pair_weight(model: torch.nn.Module) -> float:
    """One attended query-key pair's multiply-adds against the rest of a token's forward pass, estimated from the
    config: scores and weighted values take 2 x hidden per layer, the weights one per parameter."""
    config = model.config.get_text_config()
    return 2 * config.hidden_size * config.num_hidden_layers / sum(weight.numel() for weight in model.parameters())


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention kernels transformers runs ``model`` with (``sdpa``, ``eager``, ``flash_attention_2``, ...)."""
    return getattr(model.config, "_attn_implementation", None) or "sdpa"


def autocast_dtype(model: torch.nn.Module, fsdp: FSDPConfig, parallel: DataParallel) -> torch.dtype | None:
    """The dtype one rank's forward passes autocast to: ``fsdp_config.mixed_precision.param_dtype`` when it is a
    half precision the model's parameters are not in (sharded, FSDP2's MixedPrecisionPolicy applies it instead);
    the parameters, gradients and optimizer state keep the model's dtype. None: compute in the model's dtype."""
    name = fsdp.mixed_precision.param_dtype
    if parallel.sharded or name not in ("bfloat16", "float16"):
        return None
    dtype = getattr(torch, name)
    return None if next(model.parameters()).dtype == dtype else dtype


def weights_digest(model: torch.nn.Module, parallel: DataParallel) -> str | None:
    """sha256 over every tensor of the model, unsharded (rank 0; others: None): names the exact weights a
    cached forward pass used, whatever the number of ranks."""
    weights = parallel.full_state_dict(model)
    return tensors_digest(weights) if parallel.is_rank_zero else None


def micro_batches(
    batch: TensorDict,
    parallel: DataParallel,
    *,
    size: int | None,
    max_tokens: int | None = None,
    keep_together: torch.Tensor | None = None,
) -> Iterator[tuple[list[int], TensorDict]]:
    """This rank's rows of ``batch`` (:meth:`DataParallel.shares`) as micro-batches, each with the indices of its
    rows in ``batch`` and its response padding trimmed to its own longest response: ``max_tokens`` (dynamic bsz):
    balanced groups of at most that many real tokens (:func:`~.packing.token_budget_parts`), the rows of one
    ``keep_together`` id (:func:`sharing_groups`) side by side where the budget allows; else slices of at most
    ``size`` rows (all rows when None). With data-parallel ranks every rank cuts as many micro-batches as the
    rank that needs most (each forward pass is a collective), near-equal slices in rows."""
    shares = parallel.shares(batch)
    rows = shares[parallel.rank]
    if max_tokens is not None:
        lengths = sequence_lengths(batch)
        items = [budget_items(share, lengths, keep_together, max_tokens) for share in shares]
        cuts = token_budget_parts(
            [[sum(lengths[row] for row in item) for item in share] for share in items], max_tokens
        )
        mine = items[parallel.rank]
        groups = [sorted(row for index in cut for row in mine[index]) for cut in cuts[parallel.rank]]
    elif (count := parallel.micro_count(batch, size)) is not None:
        groups = [part.tolist() for part in torch.tensor(rows, dtype=torch.long).tensor_split(count)]
    else:
        size = size or len(rows)
        groups = [rows[start : start + size] for start in range(0, len(rows), size)]
    if not all(groups):
        raise ValueError(f"{len(rows)} rows cannot make {len(groups)} micro-batches (as many as another rank's)")
    for group in groups:
        yield group, trim_response_padding(batch[torch.tensor(group)])


def pad_responses(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenate per-micro-batch [n, r] outputs, zero-padding each back to ``width`` columns."""
    return torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1])) for part in parts])


def mini_batches(batch: TensorDict, size: int, *, shuffle: bool, generator: torch.Generator) -> Iterator[TensorDict]:
    """The batch split into mini-batches of ``size`` rows, optionally in a shuffled order."""
    order = torch.randperm(batch.batch_size[0], generator=generator) if shuffle else torch.arange(batch.batch_size[0])
    for start in range(0, len(order), size):
        yield batch[order[start : start + size]]


MicroLoss = Callable[[TensorDict, float, float], tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]]
"""``(micro_batch, num_tokens, num_seqs) -> (loss, summed, averaged)``: the loss to backpropagate,
metrics that are already normalised by the whole mini-batch (summed over micro-batches), and
per-micro-batch token means (averaged, weighted by the micro-batch's share of the mini-batch's tokens, so
they are means over its tokens however it is cut into micro-batches and ranks)."""


class Learner:
    """A model with its AdamW optimizer and warm-up schedule, trained by verl's PPO update loop; with
    several data-parallel ranks each trains on its share of every mini-batch (:mod:`.data_parallel`).
    ``nonfinite`` is ``trainer.nonfinite``: what a mini-batch with a non-finite loss or gradient does."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: OptimConfig,
        *,
        grad_clip: float,
        device: torch.device,
        parallel: DataParallel,
        nonfinite: str,
        remove_padding: bool = False,
    ):
        self.model, self.grad_clip, self.device, self.parallel = model, grad_clip, device, parallel
        self.nonfinite, self.remove_padding = nonfinite, remove_padding
        trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]  # LoRA: the adapter
        # fused: one kernel over all tensors instead of a loop of element-wise ops per tensor (what transformers'
        # Trainer, and so TRL, uses by default); sharded parameters (DTensors) keep the per-tensor loop.
        self.optimizer = torch.optim.AdamW(
            trainable,
            lr=optim.lr,
            betas=tuple(optim.betas),
            weight_decay=optim.weight_decay,
            fused=not parallel.sharded,
        )
        warmup = optim.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda update: min(1.0, (update + 1) / warmup) if warmup else 1.0
        )

    def train(
        self,
        batch: TensorDict,
        micro_loss: MicroLoss,
        *,
        epochs: int,
        mini_batch_size: int,
        micro_batch_size: int | None,
        max_token_len: int | None = None,
        shuffle: bool,
        generator: torch.Generator,
        prefix: str,
        step: int,
    ) -> dict[str, float]:
        """For each epoch and mini-batch: accumulate the micro-batch losses of this rank's rows (normalised by
        the whole mini-batch, so however :func:`micro_batches` cuts it: ``micro_batch_size`` rows, or at most
        ``max_token_len`` tokens each with dynamic bsz), sum over ranks, clip, step; mean metrics.

        A mini-batch whose loss, metrics or gradient norm is not finite takes no optimizer (or schedule) step:
        ``fail`` raises :class:`NonFiniteError` naming the step, stage, epoch and mini-batch; ``skip`` warns,
        counts it in ``<prefix>/nonfinite_skipped`` and goes on (``<prefix>/optimizer_steps``: those made).
        Every rank sees the same summed values and norm, so all decide alike."""
        self.model.train()
        rows, skipped = [], 0
        count = -(-batch.batch_size[0] // mini_batch_size)
        for epoch in range(epochs):
            for index, mini in enumerate(mini_batches(batch, mini_batch_size, shuffle=shuffle, generator=generator)):
                num_tokens = float(mini["response_mask"].sum())
                num_seqs = float(mini["response_mask"].any(dim=1).sum())
                totals: dict[str, float] = {}
                together = sharing_groups(self.model, mini, self.remove_padding) if max_token_len else None
                cuts = micro_batches(
                    mini, self.parallel, size=micro_batch_size, max_tokens=max_token_len, keep_together=together
                )
                for _, micro in cuts:
                    share = float(micro["response_mask"].sum()) / num_tokens if num_tokens else 0.0
                    loss, summed, averaged = micro_loss(micro.to(self.device), num_tokens, num_seqs)
                    loss.backward()
                    for name, value in summed.items():
                        totals[name] = totals.get(name, 0.0) + float(value.detach())
                    for name, value in averaged.items():
                        totals[name] = totals.get(name, 0.0) + float(value.detach()) * share
                totals = self.parallel.sum_metrics(totals)
                totals[f"{prefix}/grad_norm"] = self._clip_gradients()
                if nonfinite_values(totals):
                    self.optimizer.zero_grad(set_to_none=True)
                    problem = (
                        f"step {step} update_{prefix}, epoch {epoch + 1} of {epochs}, mini-batch {index + 1} of "
                        f"{count}: non-finite {describe_values(totals)}"
                    )
                    if self.nonfinite == "fail":
                        raise NonFiniteError(problem)
                    logger.warning("%s; its optimizer step is skipped (trainer.nonfinite=skip)", problem)
                    skipped += 1
                    continue
                self._step()
                totals[f"{prefix}/lr"] = self.optimizer.param_groups[0]["lr"]
                rows.append(totals)
        return {
            **mean_metrics(rows),
            f"{prefix}/optimizer_steps": float(len(rows)),
            f"{prefix}/nonfinite_skipped": float(skipped),
        }

    def save(self, directory: str) -> dict[str, dict]:
        """Checkpoint the model, optimizer and LR schedule into ``directory``; manifest entries by file name
        (rank 0; others: {}). One rank writes full weights (``model.safetensors``; with LoRA the adapter's, see
        :func:`trained_state_names`) and ``optimizer.pt``; data-parallel ranks each write their shards at once
        (:meth:`DataParallel.save_sharded`)."""
        if self.parallel.sharded:
            return self.parallel.save_sharded(
                directory, self.model, self.optimizer, {"scheduler": self.scheduler.state_dict()}
            )
        names = trained_state_names(self.model)
        weights = {name: tensor for name, tensor in self.model.state_dict().items() if name in names}
        state = {
            "optimizer": self.parallel.full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
        }
        return save_module(directory, weights, state)

    def load(self, directory: str, entries: dict[str, dict]) -> None:
        """Restore model, optimizer and schedule from a checkpoint written with any number of ranks."""
        if "model.safetensors" not in entries:
            state = DataParallel.load_sharded(directory, entries, self.model, self.optimizer)
        else:
            names = trained_state_names(self.model)
            shapes = {name: tensor.shape for name, tensor in self.model.state_dict().items() if name in names}
            weights, state = load_module(directory, entries, shapes)
            self.parallel.load_full(self.model, self.optimizer, weights, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _clip_gradients(self) -> float:
        """Clip the gradients to ``grad_clip``; their norm before clipping, over all ranks."""
        total_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        return float(total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm)

    def _step(self) -> None:
        """One optimizer and schedule step on the (finite) gradients, which are then cleared."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()


def trained_state_names(model: torch.nn.Module) -> set[str]:
    """The state a checkpoint holds: the model's (:func:`unique_state_names`) but its frozen parameters, which
    load from ``model.path`` again (with LoRA: the adapter alone; in full fine-tuning: everything)."""
    frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
    return unique_state_names(model) - frozen


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the mini-batches that reported it."""
    names = {name for row in rows for name in row}
    return {
        name: sum(row[name] for row in rows if name in row) / sum(name in row for row in rows) for name in sorted(names)
    }
