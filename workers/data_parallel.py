"""Data-parallel training ranks: a training role (actor, reference, critic) run as W Ray actors joined in
one torch.distributed process group, the model sharded over them with FSDP2.

Every rank receives the whole step batch (one object in Ray's store, read by reference) and works out
its own rows itself, so the driver never cuts batches up and no rank needs to be told which rows are its:

* :func:`balanced_partition` is verl's ``balance_batch``: equal row counts per rank with the tokens
  balanced between them, deterministic, so every rank computes the same split from the same rows.
* Losses are normalised by the token and sequence counts of the *global* mini-batch (verl's
  ``agg_loss`` with ``dp_size``), and FSDP2 is told to sum gradients rather than average them, so an
  update does not depend on W beyond floating-point reordering.
* Metrics are sums of per-micro-batch parts already weighted by the global mini-batch
  (:class:`~ppoflow.workers.training.Learner`), so summing them over ranks gives W=1's values.
* Outputs (log-probs, values) and full weights are gathered on rank 0, which returns them; the other
  ranks return None. A full state dict is what checkpoints, weight sync and the Hugging Face export
  take, so their files do not depend on W and a run can resume with another W.

With one rank there is no process group and the model trains unsharded: the same code, no collectives.
"""

from __future__ import annotations

import datetime
import math
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from ppoflow.configs.schema import FSDPConfig

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for a rank that does not arrive (a crashed peer) before it fails the call."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RankInfo:
    """What one rank needs to join its role's process group (the driver hands it to each rank's actor)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def free_port() -> tuple[str, int]:
    """This node's address and a TCP port free on it now: where a role's rank 0 will listen. Runs on
    rank 0's node (a Ray task placed in its bundle), because the other ranks connect there."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        return ray.util.get_node_ip_address(), probe.getsockname()[1]


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Split row indices ``0..len(lengths)-1`` into ``parts`` lists of equal size (the first ones one
    longer when it does not divide) with balanced sums of ``lengths``: longest rows first, each to the
    part with the fewest tokens that still has room (ties: the lower part). Each part is sorted."""
    sizes = [len(lengths) // parts + (part < len(lengths) % parts) for part in range(parts)]
    members: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for row in sorted(range(len(lengths)), key=lambda row: (-lengths[row], row)):
        part = min((part for part in range(parts) if len(members[part]) < sizes[part]), key=lambda p: (tokens[p], p))
        members[part].append(row)
        tokens[part] += lengths[row]
    return [sorted(rows) for rows in members]


def row_tokens(batch: TensorDict) -> list[int]:
    """Real tokens (prompt + response) of each row: what a forward pass over it costs."""
    return (batch["prompt_mask"].sum(dim=1) + batch["response_mask"].sum(dim=1)).tolist()


class DataParallel:
    """One rank's view of its role's process group: its rows of a batch, gathering results on rank 0,
    summing metrics, and full (unsharded) state dicts."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size

    @classmethod
    def join(cls, ranks: RankInfo | None, device: torch.device) -> "DataParallel":
        """Join the role's process group (NCCL on GPUs, gloo on CPUs); one rank: no group at all."""
        if ranks is None or ranks.world_size == 1:
            return cls()
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=ranks.rank,
                                world_size=ranks.world_size, timeout=PROCESS_GROUP_TIMEOUT,
                                init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}")
        return cls(ranks.rank, ranks.world_size)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    def shard(self, model: torch.nn.Module, fsdp: FSDPConfig) -> torch.nn.Module:
        """FSDP2: ``fully_shard`` each transformer block (the model's ``_no_split_modules``), then the root;
        mixed precision and CPU offload from ``fsdp_config``; gradients summed over ranks, not averaged."""
        if not self.sharded:
            return model
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        precision = fsdp.mixed_precision
        options = {"reshard_after_forward": fsdp.reshard_after_forward,
                   "mp_policy": MixedPrecisionPolicy(param_dtype=_DTYPES.get(precision.param_dtype),
                                                     reduce_dtype=_DTYPES[precision.reduce_dtype]),
                   "offload_policy": CPUOffloadPolicy() if fsdp.offload_policy else OffloadPolicy()}
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        sharded = [fully_shard(module, **options) for module in model.modules() if type(module).__name__ in block_names]
        root = fully_shard(model, **options)
        for module in [*sharded, root]:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain sums: gloo has no pre-multiplied sum
        return root

    def local_rows(self, batch: TensorDict) -> TensorDict:
        """This rank's rows of ``batch`` (all of them with one rank), by :func:`balanced_partition`."""
        if not self.sharded:
            return batch
        if batch.batch_size[0] < self.world_size:
            raise ValueError(f"{batch.batch_size[0]} rows cannot give each of {self.world_size} ranks one")
        return batch[torch.tensor(self.rows_of(batch))]

    def rows_of(self, batch: TensorDict) -> list[int]:
        return balanced_partition(row_tokens(batch), self.world_size)[self.rank]

    def gather_rows(self, batch: TensorDict, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the full [N, ...] result whose rows :meth:`local_rows` gave each rank; others: None."""
        if not self.sharded:
            return local
        return self.gather_indexed(self.rows_of(batch), local, batch.batch_size[0])

    def gather_indexed(self, rows: Sequence[int], values: torch.Tensor, total: int) -> torch.Tensor | None:
        """Rank 0: a [total, ...] tensor holding every rank's ``values`` at its ``rows``; others: None."""
        if not self.sharded:
            return values[torch.argsort(torch.as_tensor(rows))]
        import torch.distributed as dist

        parts = [None] * self.world_size if self.is_rank_zero else None
        dist.gather_object((list(rows), values.cpu()), parts, dst=0)
        if not self.is_rank_zero:
            return None
        out = torch.zeros((total, *values.shape[1:]), dtype=values.dtype)
        for part_rows, part_values in parts:
            out[torch.as_tensor(part_rows)] = part_values
        return out

    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Each metric summed over the ranks (every rank reports the same names)."""
        if not self.sharded:
            return totals
        import torch.distributed as dist

        names = sorted(totals)
        values = torch.tensor([totals[name] for name in names], dtype=torch.float64)
        dist.all_reduce(values)
        return dict(zip(names, values.tolist()))

    def micro_count(self, batch: TensorDict, size: int | None) -> int | None:
        """How many micro-batches every rank cuts its rows of ``batch`` into: the same on each rank (each
        forward pass is a collective), enough for the largest share; None with one rank (slices of ``size``)."""
        if not self.sharded:
            return None
        largest = math.ceil(batch.batch_size[0] / self.world_size)
        return math.ceil(largest / size) if size else 1

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every entry of ``model.state_dict()`` unsharded, detached (rank 0, on the CPU when sharded; others: {})."""
        if not self.sharded:
            return {name: tensor.detach() for name, tensor in model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state keyed by parameter name, unsharded (rank 0; others: {}): one format for any W."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=self.sharded))

    def load_full(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  weights: dict[str, torch.Tensor], optimizer_state: dict | None) -> None:
        """Load unsharded weights (and optimizer state) that every rank read, each keeping its shard."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=options)
        if optimizer is not None and optimizer_state is not None:
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)

    def barrier(self) -> None:
        if self.sharded:
            import torch.distributed as dist

            dist.barrier()


def unique_state_names(model: torch.nn.Module) -> set[str]:
    """Names of the model's state without aliases (tied embeddings are one parameter under two names;
    safetensors refuses the duplicate): its parameters and persistent buffers, each once."""
    names = {name for name, _ in model.named_parameters()}
    return names | {name for name in model.state_dict() if name not in dict(model.named_parameters(remove_duplicate=False))}
