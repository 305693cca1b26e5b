"""Stage 1, generate: sample ``rollout.n`` responses per prompt on the rollout worker."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from workers.rollout import SamplingParams


@task(name="generate", cache_policy=NO_CACHE)
def generate(workers, prompts: TensorDict, step: int, sampling: SamplingParams) -> TensorDict:
    """The rollout part of the step batch (see ``storage.batch``) for one prompt batch."""
    return workers.get(workers.rollout.submit("generate", prompts, step=step, sampling=sampling))
