"""Stage 3b, values: the critic's value of every response position (GAE needs them)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ppoflow.tasks.caching import StageRecord, StepDump, dump_stage


@task(name="values", cache_policy=NO_CACHE)
def values(workers, batch_ref, dump: StepDump | None = None) -> StageRecord:
    """``values`` [N, R] from the critic worker."""
    return dump_stage(dump, workers.get(workers.critic.submit("compute_values", batch_ref)), {})
