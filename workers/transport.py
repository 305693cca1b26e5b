"""How step batches cross between the run's processes (the driver and its Ray workers).

Ray pickles what a call sends, and a TensorDict pickled as it is costs several times its bytes, so every process of
a run registers :func:`send_batches_as_plain_values` with Ray: a batch travels as
:func:`~ppoflow.storage.batch.plain_batch`'s plain values (numpy buffers, lists) and is rebuilt on arrival. Ray keeps
serializers per process, so the driver (``start_workers``) and each worker (``set_up_worker_process``) call it.
Nothing read from storage comes this way (storage uses :func:`~ppoflow.storage.batch.decode_batch`).
Figures: docs/benchmarks.md#a-batchs-trip-to-a-worker-and-back.
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
