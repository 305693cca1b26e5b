"""Moving the actor's weights into the rollout worker (the ``weight_sync`` stage).

Tensors are packed into flat ``uint8`` buckets of at most ``weight_sync.bucket_mb`` MiB (:class:`TensorSlot`
layouts), moved by the ``object_store`` backend (through Ray's shared memory, never the driver) or ``nccl`` /
``gloo`` (a Ray collective group); ``delta`` sends only tensors that changed. With one_step_off the actor keeps a
copy of what it sent, so a restarted rollout worker can get the weights its lost batch was started with. In-process
(no Ray) a bucket is handed over as a tensor. Details: docs/architecture.md#weight-sync.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ppoflow.configs.schema import WeightSyncConfig


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives inside a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class WeightUpdate:
    """One sync: the weight version, the layout of each bucket, and (object store) the buckets."""

    version: int
    layouts: list[list[TensorSlot]]
    payloads: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for layout in self.layouts for slot in layout)


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[TensorSlot]]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    layouts: list[list[TensorSlot]] = []
    current: list[TensorSlot] = []
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and offset + nbytes > bucket_bytes:
            layouts.append(current)
            current, offset = [], 0
        current.append(TensorSlot(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    if current:
        layouts.append(current)
    return layouts


def bucket_size(layout: list[TensorSlot]) -> int:
    return layout[-1].offset + layout[-1].nbytes


def pack(state: dict[str, torch.Tensor], layout: list[TensorSlot], device: torch.device) -> torch.Tensor:
    """Copy the layout's tensors into one flat ``uint8`` bucket on ``device``."""
    bucket = torch.empty(bucket_size(layout), dtype=torch.uint8, device=device)
    for slot in layout:
        bucket[slot.offset : slot.offset + slot.nbytes].copy_(state[slot.name].detach().reshape(-1).view(torch.uint8))
    return bucket


def unpack_into(state: dict[str, torch.Tensor], layout: list[TensorSlot], bucket: torch.Tensor) -> None:
    """Copy each slot of a packed ``bucket`` into the tensor of the same name (in place)."""
    for slot in layout:
        source = bucket[slot.offset : slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)
        state[slot.name].copy_(source, non_blocking=True)


class WeightSender:
    """The actor's side: lays out (and for the object store, publishes) the weights to send.

    ``keep_copy`` keeps a copy of the weights last sent (beside the originals), so that they can be sent again
    (:meth:`prepare_again`) to a rollout worker that lost them after generation moved on; ``delta``
    keeps one anyway, to know what changed.
    """

    def __init__(self, sync: WeightSyncConfig, *, keep_copy: bool = False):
        self.sync = sync
        self.keep_copy = keep_copy or sync.delta
        self.last_sent: dict[str, torch.Tensor] = {}
        self.last_version: int | None = None
        self.group: str | None = None

    def prepare(self, weights: dict[str, torch.Tensor], version: int) -> tuple[WeightUpdate, dict]:
        """The update to send (all of ``weights`` - the model's full state dict, or with LoRA the adapter's
        tensors - or only the tensors that changed with ``delta``) and its source tensors."""
        state = {name: tensor.detach() for name, tensor in weights.items()}
        if self.sync.delta:
            state = {
                name: tensor
                for name, tensor in state.items()
                if name not in self.last_sent or not torch.equal(tensor, self.last_sent[name])
            }
        if self.keep_copy:
            self.last_sent.update({name: tensor.clone() for name, tensor in state.items()})
            self.last_version = version
        return self._update(state, version), state

    def prepare_again(self) -> tuple[WeightUpdate, dict]:
        """All of the weights last sent, as they were (a restarted receiver needs every tensor)."""
        if self.last_version is None:
            raise RuntimeError("no weights were sent yet, or no copy of them was kept (keep_copy)")
        return self._update(self.last_sent, self.last_version), self.last_sent

    def forget(self) -> None:
        """The receiver's weights are unknown (a restored checkpoint): send everything next time."""
        self.last_sent.clear()
        self.last_version = None

    def broadcast(self, state: dict[str, torch.Tensor], update: WeightUpdate, device: torch.device) -> None:
        """Send the buckets over the collective group (rank 0 is the actor)."""
        from ray.util import collective

        for layout in update.layouts:
            collective.broadcast(pack(state, layout, device), src_rank=0, group_name=self.group)

    def _update(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        update = WeightUpdate(version, plan_buckets(state.items(), self.sync.bucket_mb * 2**20))
        if self.sync.backend == "object_store":
            update.payloads = [
                _publish([_raw_bytes(state[slot.name].cpu()) for slot in layout]) for layout in update.layouts
            ]
        return update


class WeightReceiver:
    """The rollout's side: copies an update's buckets into the model's tensors."""

    def __init__(self):
        self.group: str | None = None

    def apply(self, model: torch.nn.Module, update: WeightUpdate, device: torch.device) -> int:
        state = model.state_dict()
        for index, layout in enumerate(update.layouts):
            if update.payloads:  # object store: map each tensor's bytes (read-only, shared memory), copy out
                for slot, raw in zip(layout, _fetch(update.payloads[index])):
                    _copy_slot(state[slot.name], slot, raw)
            else:  # collective: receive the packed bucket into a buffer on this worker's device
                from ray.util import collective

                bucket = torch.empty(bucket_size(layout), dtype=torch.uint8, device=device)
                collective.broadcast(bucket, src_rank=0, group_name=self.group)
                unpack_into(state, layout, bucket)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return update.version


def _raw_bytes(tensor: torch.Tensor):
    """A tensor's bytes as a flat uint8 NumPy view (NumPy has no bfloat16; bytes travel zero-copy)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _fetch(payload) -> list:
    """A bucket's per-tensor byte arrays: mapped from the object store, or as handed over in-process."""
    if isinstance(payload, list):
        return payload
    import ray

    return ray.get(payload)


def _copy_slot(target: torch.Tensor, slot: TensorSlot, raw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only shared-memory buffer: we only read it
        source = torch.frombuffer(memoryview(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    target.copy_(source.view(getattr(torch, slot.dtype)).view(slot.shape), non_blocking=True)


def _publish(arrays: list):
    """Inside a Ray actor, put a bucket into the shared-memory object store (the actor owns it and
    the driver only sees a reference); in-process, hand over the arrays themselves."""
    try:
        import ray

        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except ImportError:
        in_actor = False
    return ray.put(arrays) if in_actor else arrays


def join_group(backend: str, group: str, rank: int) -> None:
    """Join the two-member weight-sync collective group (actor rank 0, rollout rank 1)."""
    from ray.util import collective

    collective.init_collective_group(world_size=2, rank=rank, backend=backend, group_name=group)
