"""Stage 6, weight_sync: the rollout worker takes the actor's new weights.

The exported weights travel actor -> Ray object store -> rollout worker as a reference; they never
pass through the driver.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="weight_sync", cache_policy=NO_CACHE)
def weight_sync(workers) -> int:
    """Copy the actor's weights into the rollout worker; returns the weight version now served."""
    exported = workers.actor.submit("export_weights")
    return workers.get(workers.rollout.submit("load_weights", exported))
