"""Stage 3, old_log_prob and ref_log_prob: forward passes of the policy before its update, and of
the frozen reference policy (only when a KL term needs it)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from ppoflow.tasks.caching import StageRecord, StepDump, dump_stage


@task(name="old_log_prob", cache_policy=NO_CACHE)
def old_log_prob(workers, batch_ref, dump: StepDump | None = None) -> StageRecord:
    """``old_log_probs`` [N, R] of the responses under the current (pre-update) actor weights."""
    out = workers.get(workers.actor.submit("compute_log_prob", batch_ref))
    return dump_stage(dump, TensorDict({"old_log_probs": out["log_probs"]}, batch_size=out.batch_size), {})


@task(name="ref_log_prob", cache_policy=NO_CACHE)
def ref_log_prob(workers, batch_ref, dump: StepDump | None = None) -> StageRecord:
    """``ref_log_probs`` [N, R] of the responses under the reference policy."""
    out = workers.get(workers.ref.submit("compute_log_prob", batch_ref))
    return dump_stage(dump, TensorDict({"ref_log_probs": out["log_probs"]}, batch_size=out.batch_size), {})
