"""Stage 1 of the async trainer modes, sample: the step's batch from the replay buffer (verl V1's
``replay_buffer.sample`` under the ``gen`` timer)."""

from __future__ import annotations

from collections.abc import Callable

from prefect.cache_policies import NO_CACHE

from ppoflow.storage.batch import StageResult
from ppoflow.storage.replay_buffer import ReplayBuffer
from ppoflow.tasks.generate import rollout_metrics
from ppoflow.tasks.task_inputs import recorded_task


@recorded_task(name="sample", cache_policy=NO_CACHE)
def sample(
    buffer: ReplayBuffer, step: int, batch_size: int, poll: Callable[[float], None], in_order: bool = False
) -> StageResult:
    """The ``batch_size`` oldest finished prompt groups (``in_order``: the oldest prompts, once all are
    finished), waiting for the rollout (``poll`` takes in the groups that finished) while too few are; the
    buffer's staleness and eviction metrics, and the rollout's own (agent loops, streamed reward extras,
    sample cache)."""
    batch, buffer_metrics = buffer.sample(step, batch_size, poll=poll, in_order=in_order)
    batch, metrics = rollout_metrics(batch)
    return StageResult(batch, {**metrics, **buffer_metrics})
