"""Stage 5, update_critic and update_actor: PPO epochs on the critic and the policy workers."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

from ppoflow.storage.batch import StageResult
from ppoflow.tasks.task_inputs import recorded_task


@recorded_task(name="update_critic", cache_policy=NO_CACHE)
def update_critic(workers, batch_ref, step: int) -> StageResult:
    """Clipped value-loss update; its metrics are ``critic/*``."""
    return StageResult(None, workers.critic.update(batch_ref, step=step))


@recorded_task(name="update_actor", cache_policy=NO_CACHE)
def update_actor(workers, batch_ref, step: int) -> StageResult:
    """PPO clip-loss update of the policy; its metrics are ``actor/*``, and when the update was on-policy
    its field is ``old_log_probs``, its own detached log-probs."""
    return workers.actor.update(batch_ref, step=step)
