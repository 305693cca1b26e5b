"""Stage 2a, reward_model: each response's model-based score, ``rm_scores`` [N], from the run's reward model worker
or its HTTP reward service (``reward_model.enable``, ``reward_model.remote.url``); the reward stage then combines
it with the rule scores (``reward_model.combine``). Never retried here: the service's client retries each request
itself, and a reward model that failed would fail again. Details: docs/reward_models.md.
"""

from __future__ import annotations

import torch
from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from ppoflow.storage.batch import StageResult, non_tensor_column
from ppoflow.tasks.reward import decode_responses
from ppoflow.tasks.task_inputs import recorded_task
from ppoflow.workers.remote_reward import REMOTE_ERRORS, RewardSample


def reward_samples(batch: TensorDict, tokenizer) -> list[RewardSample]:
    """Each response as a model-based reward sees it: its prompt decoded without padding or special tokens, its
    response as a scorer sees it, and the row's uid, data source, ground truth and extra_info."""
    prompts = [
        tokenizer.decode(ids[mask].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch["prompts"], batch["prompt_mask"])
    ]
    extra_infos = non_tensor_column(batch, "extra_info") if "extra_info" in batch.keys() else [None] * len(prompts)
    rows = zip(
        non_tensor_column(batch, "uid"),
        non_tensor_column(batch, "data_source"),
        prompts,
        decode_responses(batch, tokenizer),
        non_tensor_column(batch, "ground_truth"),
        extra_infos,
        strict=True,
    )
    return [RewardSample(*row) for row in rows]


@recorded_task(name="reward_model", cache_policy=NO_CACHE)
def reward_model(batch: TensorDict, tokenizer, model_reward) -> StageResult:
    """``rm_scores`` [N] from ``model_reward`` (a reward model role or a reward service client, each with
    ``score(samples) -> (scores, extras)``); metrics ``reward_model/score/mean`` (and ``/max``, ``/min``),
    ``reward_model/<extra>/mean`` of each extra a service reported, ``reward_model/remote_errors`` (responses that
    scored ``reward_model.remote.error_score``)."""
    scores, extras = model_reward.score(reward_samples(batch, tokenizer))
    values = torch.tensor(scores, dtype=torch.float32)
    metrics = {
        "reward_model/score/mean": float(values.mean()),
        "reward_model/score/max": float(values.max()),
        "reward_model/score/min": float(values.min()),
    }
    for name, found in extras.items():
        if name == REMOTE_ERRORS:
            metrics[f"reward_model/{name}"] = float(sum(found))
        else:
            metrics[f"reward_model/{name}/mean"] = sum(found) / len(found)
    return StageResult(TensorDict({"rm_scores": values}, batch_size=batch.batch_size), metrics)
