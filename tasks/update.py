"""Stage 5, update_critic and update_actor: PPO epochs on the critic and the policy workers."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE


@task(name="update_critic", cache_policy=NO_CACHE)
def update_critic(workers, batch_ref, step: int) -> dict[str, float]:
    """Clipped value-loss update; returns ``critic/*`` metrics."""
    return workers.get(workers.critic.submit("update", batch_ref, step=step))


@task(name="update_actor", cache_policy=NO_CACHE)
def update_actor(workers, batch_ref, step: int) -> dict[str, float]:
    """PPO clip-loss update of the policy; returns ``actor/*`` metrics."""
    return workers.get(workers.actor.submit("update", batch_ref, step=step))
