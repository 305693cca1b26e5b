"""Stage 3b, values: the critic's value of every response position (GAE needs them)."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

from ppoflow.storage.batch import StageResult
from ppoflow.tasks.task_inputs import recorded_task


@recorded_task(name="values", cache_policy=NO_CACHE)
def values(workers, batch_ref) -> StageResult:
    """``values`` [N, R] from the critic worker."""
    return StageResult(workers.critic.compute_values(batch_ref))
