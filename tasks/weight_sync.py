"""Stage 6, weight_sync: the rollout worker takes the actor's new weights.

The update (bucket layouts, and with the object-store backend references to the buckets the actor
published) travels actor -> rollout by reference; the weights never pass through the driver. With a
collective backend both workers take part in the broadcast, so both calls run at once.
"""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

from ppoflow.storage.batch import StageResult
from ppoflow.tasks.task_inputs import recorded_task


@recorded_task(name="weight_sync", cache_policy=NO_CACHE)
def weight_sync(workers, collective: bool, again: bool = False, version: int | None = None) -> StageResult:
    """Move the actor's current weights into the rollout worker (which then stamps ``version`` - the
    trainer's weight version - on what it samples); ``again``: the weights pushed last time (a restarted
    rollout worker lost them)."""
    update = workers.actor.start_prepare_weights(again=again, version=version)
    applied = workers.rollout.start_apply_weights(update)
    if collective:
        workers.get([workers.actor.start_broadcast_weights(update), applied])
    workers.get(applied)
    return StageResult(None)
