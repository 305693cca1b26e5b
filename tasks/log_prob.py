"""Stage 3, old_log_prob and ref_log_prob: forward passes of the policy before its update, and of
the frozen reference policy (only when a KL term needs it)."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from ppoflow.storage.batch import StageResult
from ppoflow.tasks.task_inputs import recorded_task


@recorded_task(name="old_log_prob", cache_policy=NO_CACHE)
def old_log_prob(workers, batch_ref, at_step_start: bool = False) -> StageResult:
    """``old_log_probs`` [N, R] of the responses under the current (pre-update) actor weights; with
    ``at_step_start``, under the weights the step started with (separate_async's later mini-batches:
    decoupled PPO, one π_old per step)."""
    out = workers.actor.compute_log_prob(batch_ref, at_step_start=at_step_start)
    return StageResult(TensorDict({"old_log_probs": out["log_probs"]}, batch_size=out.batch_size))


@recorded_task(name="ref_log_prob", cache_policy=NO_CACHE)
def ref_log_prob(workers, batch_ref) -> StageResult:
    """``ref_log_probs`` [N, R] of the responses under the reference policy."""
    out = workers.ref.compute_log_prob(batch_ref)
    return StageResult(TensorDict({"ref_log_probs": out["log_probs"]}, batch_size=out.batch_size))
