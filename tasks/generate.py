"""Stage 1, generate: sample ``rollout.n`` responses per prompt on the rollout worker."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from ppoflow.storage.batch import NON_TENSOR_FIELDS, StageResult
from ppoflow.storage.step_cache.stage_cache import cacheable
from ppoflow.workers.rollout import SamplingParams


@task(name="generate", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
@cacheable
def generate(workers, prompts: TensorDict, step: int, sampling: SamplingParams) -> StageResult:
    """The rollout part of the step batch (see ``storage.batch``) for one prompt batch.

    Only tensors travel to the rollout worker; the per-prompt columns (uid, data_source,
    ground_truth) stay here and are repeated onto the prompt's ``n`` responses. Retried: a rollout
    worker that died mid-generation is restarted by Ray, and the flow re-syncs its weights.
    """
    rollout = workers.get(workers.rollout.submit("generate", prompts.exclude(*NON_TENSOR_FIELDS), step=step,
                                                 sampling=sampling))
    return StageResult(rollout.update(prompts.select(*NON_TENSOR_FIELDS)[rollout["group_index"]]))
