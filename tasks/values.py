"""Stage 3b, values: the critic's value of every response position (GAE needs them)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict


@task(name="values", cache_policy=NO_CACHE)
def values(workers, batch_ref) -> TensorDict:
    """``values`` [N, R] from the critic worker."""
    return workers.get(workers.critic.submit("compute_values", batch_ref))
