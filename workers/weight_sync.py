"""Moving the actor's weights into the rollout worker (the ``weight_sync`` stage).

Per-tensor transfers are the known slow path (many small messages), so tensors are packed into flat
``uint8`` buckets of at most ``weight_sync.bucket_mb`` MiB, described by :class:`TensorSlot` layouts:

* ``object_store`` — the actor writes each bucket into Ray's shared-memory object store itself and
  returns only references; the rollout worker maps the bucket without copying and copies it into
  its parameters. The weights never pass through the driver.
* ``nccl`` / ``gloo`` — the actor and the rollout worker join one Ray collective group
  (``ray.util.collective``); each sync the actor broadcasts its buckets and the rollout receives
  them into buffers on its own device (GPU to GPU with NCCL; gloo does the same on CPUs).
* ``delta`` — the actor keeps a copy of what it last sent and packs only tensors whose values
  changed (frozen layers, adapters); the first sync sends everything.

The same code runs in-process (no Ray): then a bucket is handed over as a tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from configs.schema import WeightSyncConfig


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
        bucket[slot.offset:slot.offset + slot.nbytes].copy_(state[slot.name].detach().reshape(-1).view(torch.uint8))
    return bucket


def unpack_into(state: dict[str, torch.Tensor], layout: list[TensorSlot], bucket: torch.Tensor) -> None:
    """Copy each slot of ``bucket`` into the tensor of the same name (in place, on its own device)."""
    for slot in layout:
        target = state[slot.name]
        source = bucket[slot.offset:slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)
        target.copy_(source, non_blocking=True)


class WeightSender:
    """The actor's side: lays out (and for the object store, publishes) the weights to send."""

    def __init__(self, sync: WeightSyncConfig):
        self.sync = sync
        self.last_sent: dict[str, torch.Tensor] = {}
        self.group: str | None = None

    def prepare(self, model: torch.nn.Module, version: int) -> tuple[WeightUpdate, dict]:
        """The update to send (all tensors, or only the changed ones with ``delta``) and its source tensors."""
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        if self.sync.delta:
            changed = {name: tensor for name, tensor in state.items()
                       if name not in self.last_sent or not torch.equal(tensor, self.last_sent[name])}
            self.last_sent.update({name: tensor.clone() for name, tensor in changed.items()})
            state = changed
        update = WeightUpdate(version, plan_buckets(state.items(), self.sync.bucket_mb * 2**20))
        if self.sync.backend == "object_store":
            buckets = [pack(state, layout, torch.device("cpu")) for layout in update.layouts]
            update.payloads = [_publish(bucket) for bucket in buckets]
        return update, state

    def broadcast(self, state: dict[str, torch.Tensor], update: WeightUpdate, device: torch.device) -> None:
        """Send the buckets over the collective group (rank 0 is the actor)."""
        from ray.util import collective

        for layout in update.layouts:
            collective.broadcast(pack(state, layout, device), src_rank=0, group_name=self.group)


class WeightReceiver:
    """The rollout's side: copies an update's buckets into the model's tensors."""

    def __init__(self):
        self.group: str | None = None

    def apply(self, model: torch.nn.Module, update: WeightUpdate, device: torch.device) -> int:
        state = model.state_dict()
        for index, layout in enumerate(update.layouts):
            if update.payloads:  # object store: map the bucket (read-only, shared memory), copy out
                bucket = update.payloads[index]
                if not isinstance(bucket, torch.Tensor):
                    import ray

                    bucket = ray.get(bucket)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read it
                        bucket = torch.frombuffer(memoryview(bucket), dtype=torch.uint8)
            else:  # collective: receive into a buffer on this worker's device
                from ray.util import collective

                bucket = torch.empty(bucket_size(layout), dtype=torch.uint8, device=device)
                collective.broadcast(bucket, src_rank=0, group_name=self.group)
            unpack_into(state, layout, bucket.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return update.version


def _publish(bucket: torch.Tensor):
    """Inside a Ray actor, put the bucket into the shared-memory object store (the actor owns it and
    the driver only sees a reference); in-process, hand over the tensor itself."""
    try:
        import ray

        in_actor = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except ImportError:
        in_actor = False
    return ray.put(bucket.numpy()) if in_actor else bucket


def join_group(backend: str, group: str, rank: int) -> None:
    """Join the two-member weight-sync collective group (actor rank 0, rollout rank 1)."""
    from ray.util import collective

    collective.init_collective_group(world_size=2, rank=rank, backend=backend, group_name=group)
