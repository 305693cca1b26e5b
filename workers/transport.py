"""How step batches cross between the run's processes (the driver and its Ray workers).

Ray pickles what a call sends and returns. A TensorDict pickled as it is costs several times what its
bytes do (every non-tensor value is an object of its own, every tensor goes through torch's storage
pickling; docs/benchmarks.md), and a step's batch crosses on every stage that runs on a worker. So
every process of a run registers :func:`send_batches_as_plain_values` with Ray: a batch travels as
:func:`~ppoflow.storage.batch.plain_batch`'s plain values (numpy buffers, lists) and is rebuilt on
arrival. (tensordict's ``consolidate()``, which packs the tensors into one storage before pickling, is
slower still on these batches: it too handles each per-prompt value on its own; docs/benchmarks.md.)
Ray keeps serializers per process, which is why the driver (``start_workers``) and each worker
(``set_up_worker_process``) call it.

This is Ray's own channel between processes of one run, which pickles anyway; nothing read from
storage comes this way (caches and checkpoints use :func:`~ppoflow.storage.batch.decode_batch`).
"""

from __future__ import annotations

import pickle

from tensordict import TensorDict

from ppoflow.storage.batch import batch_from_plain, plain_batch


def send_batches_as_plain_values() -> None:
    """Have Ray send this process's TensorDicts as plain values (idempotent)."""
    import ray

    ray.util.register_serializer(TensorDict, serializer=_to_plain, deserializer=_from_plain)


def _to_plain(batch: TensorDict) -> tuple | bytes:
    """The batch's plain values, or, for a batch that has none (nested, on a GPU, with gradients), the
    batch pickled as it is (by ``pickle`` itself, which does not come back here)."""
    plain = plain_batch(batch)
    return plain if plain is not None else pickle.dumps(batch, protocol=5)


def _from_plain(sent: tuple | bytes) -> TensorDict:
    """The batch :func:`_to_plain` sent."""
    return pickle.loads(sent) if isinstance(sent, bytes) else batch_from_plain(sent)
