"""Data-parallel training ranks: a training role (actor, reference, critic) run as W Ray actors joined in
one torch.distributed process group, the model sharded over them with FSDP2.

Every rank receives the whole step batch and takes its own rows (:func:`balanced_partition`, verl's
``balance_batch``); losses use the global mini-batch's normalisers and FSDP2 sums gradients, so an update does not
depend on W. Outputs and full weights are gathered on rank 0; checkpoints are written by every rank in parallel
(:meth:`DataParallel.save_sharded`, DCP with its safetensors storage) and reshard on load. Without a
:class:`RankInfo` a role trains unsharded; one of world size 1 still shards (the GPU check). Details: docs/scale_out.md.
"""

from __future__ import annotations

import datetime
import io
import math
import os
import re
import socket
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tensordict import TensorDict

from ppoflow.configs.schema import FSDPConfig
from ppoflow.storage.checkpoint import CheckpointError, read_decoded, read_file, write_file
from ppoflow.storage.fs import join

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for a rank that does not arrive (a crashed peer) before it fails the call."""

SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
"""The file each rank writes its shards into (DCP's safetensors storage names it after the rank)."""
SHARDED_STATE = "optimizer.pt"
"""Beside the shards: what is not a tensor (the optimizer's parameter groups, the LR schedule), by rank 0."""

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

    def __init__(self, rank: int = 0, world_size: int = 1, *, sharded: bool = False):
        self.rank, self.world_size, self.sharded = rank, world_size, sharded

    @classmethod
    def join(cls, ranks: RankInfo | None, device: torch.device) -> DataParallel:
        """Join the role's process group (NCCL on GPUs, gloo on CPUs); no ``ranks``: no group at all."""
        if ranks is None:
            return cls()
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=ranks.rank,
            world_size=ranks.world_size,
            timeout=PROCESS_GROUP_TIMEOUT,
            init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}",
        )
        return cls(ranks.rank, ranks.world_size, sharded=True)

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
        options = {
            "reshard_after_forward": fsdp.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=_DTYPES.get(precision.param_dtype), reduce_dtype=_DTYPES[precision.reduce_dtype]
            ),
            "offload_policy": CPUOffloadPolicy() if fsdp.offload_policy else OffloadPolicy(),
        }
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        sharded = [fully_shard(module, **options) for module in model.modules() if type(module).__name__ in block_names]
        root = fully_shard(model, **options)
        for module in [*sharded, root]:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain sums: gloo has no pre-multiplied sum
        return root

    def shares(self, batch: TensorDict) -> list[list[int]]:
        """Every rank's rows of ``batch`` (with one rank: all of them), by :func:`balanced_partition`."""
        if not self.sharded:
            return [list(range(batch.batch_size[0]))]
        if batch.batch_size[0] < self.world_size:
            raise ValueError(f"{batch.batch_size[0]} rows cannot give each of {self.world_size} ranks one")
        return balanced_partition(row_tokens(batch), self.world_size)

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

    def prompt_shares(self, prompts: TensorDict) -> list[list[int]]:
        """Every rank's prompts of a step to generate from (a colocated rollout): equal counts, balanced prompt
        tokens (the responses' lengths are not known yet), so a prompt's group of samples stays on one rank."""
        if not self.sharded:
            return [list(range(prompts.batch_size[0]))]
        return balanced_partition(prompts["prompt_mask"].sum(dim=1).tolist(), self.world_size)

    def gather_rows(self, rows: Sequence[int], items: Sequence, total: int) -> list | None:
        """Rank 0: a list of ``total`` items holding every rank's ``items`` at its ``rows``; others: None."""
        parts = [(list(rows), list(items))]
        if self.sharded:
            import torch.distributed as dist

            mine, parts = parts[0], [None] * self.world_size if self.is_rank_zero else None
            dist.gather_object(mine, parts, dst=0)
            if not self.is_rank_zero:
                return None
        out: list = [None] * total
        for part_rows, part_items in parts:
            for row, item in zip(part_rows, part_items):
                out[row] = item
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

    def full_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Every entry of ``model.state_dict()`` unsharded on every rank, one tensor at a time (each rank gathers
        each sharded tensor from the others in the same order): what a rank's colocated rollout samples with,
        built without the whole unsharded state dict ever held at once."""
        for name, tensor in model.state_dict().items():
            yield name, (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()

    def full_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state of an unsharded model, keyed by parameter name (not position), so that data-
        parallel ranks can load it into their shards (:meth:`load_full`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))

    def load_full(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        weights: dict[str, torch.Tensor],
        optimizer_state: dict | None,
    ) -> None:
        """Load unsharded weights (and optimizer state) that every rank read, each keeping its shard."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=options)
        if optimizer is not None and optimizer_state is not None:
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)

    def save_sharded(
        self, directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict
    ) -> dict[str, dict]:
        """Every rank writes its shards of the weights and the optimizer state into ``directory`` at once
        (staged locally by DCP, then each file written atomically); rank 0 adds :data:`SHARDED_STATE`
        (parameter groups and ``extra``) and returns every file's manifest entry (the others: {})."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        optimizer_state = get_optimizer_state_dict(model, optimizer)
        state = {"model": _without_aliases(model, get_model_state_dict(model)), "optimizer": optimizer_state["state"]}
        with tempfile.TemporaryDirectory() as staging:
            dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(staging, save_distributed=True))
            entries = {
                name: write_file(join(directory, name), Path(staging, name).read_bytes())
                for name in sorted(os.listdir(staging))
            }
        parts = [None] * self.world_size if self.is_rank_zero else None
        dist.gather_object(entries, parts, dst=0)
        if not self.is_rank_zero:
            return {}
        buffer = io.BytesIO()
        torch.save({"param_groups": optimizer_state["param_groups"], **extra}, buffer)
        merged = {name: entry for part in parts for name, entry in part.items()}
        return {**merged, SHARDED_STATE: write_file(join(directory, SHARDED_STATE), buffer.getvalue())}

    @staticmethod
    def load_sharded(
        directory: str, entries: dict[str, dict], model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict:
        """Load what :meth:`save_sharded` wrote, with any number of ranks (or none): each file is checked
        against its manifest entry before DCP reads it, and DCP gives each rank its own shards. Returns the
        ``extra`` it was saved with; :class:`CheckpointError` when the shards do not fit the model."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        extra = read_decoded(
            directory, entries, SHARDED_STATE, lambda data: torch.load(io.BytesIO(data), weights_only=True)
        )
        shards = sorted(name for name in entries if SHARD_FILE.fullmatch(name))
        # the state to load into: the optimizer's is created (zero) by asking for it
        state = {
            "model": _without_aliases(model, get_model_state_dict(model)),
            "optimizer": get_optimizer_state_dict(model, optimizer)["state"],
        }
        with tempfile.TemporaryDirectory() as staging:
            for name in shards:
                Path(staging, name).write_bytes(read_file(join(directory, name), entries[name]))
            try:
                with warnings.catch_warnings():  # one rank without a process group is meant, not a mistake
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(
                        state,
                        storage_reader=dcp.HuggingFaceStorageReader(staging),
                        no_dist=not torch.distributed.is_initialized(),
                    )
            except Exception as error:  # DCP reports a missing or misshapen tensor in several ways
                raise CheckpointError(directory, f"the shards do not fit the model: {error}") from error
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))  # aliases: tied
        set_optimizer_state_dict(
            model, optimizer, {"state": state["optimizer"], "param_groups": extra.pop("param_groups")}
        )
        return extra


def _without_aliases(model: torch.nn.Module, state: dict) -> dict:
    """``state`` without the second name of a tied tensor (safetensors refuses shared storage)."""
    return {name: tensor for name, tensor in state.items() if name in unique_state_names(model)}


def unique_state_names(model: torch.nn.Module) -> set[str]:
    """Names of the model's state without aliases (tied embeddings are one parameter under two names;
    safetensors refuses the duplicate): its parameters and persistent buffers, each once."""
    names = {name for name, _ in model.named_parameters()}
    return names | {
        name for name in model.state_dict() if name not in dict(model.named_parameters(remove_duplicate=False))
    }
