"""Stage 2, reward: decode each response and score it with its data source's rule (or a custom scorer).

The score is placed on the response's last valid token (verl's ``token_level_scores``); everything
else is zero. Scoring runs in the flow, or - for scorers slow enough to be worth a Prefect task's
overhead inside a Ray worker (sandboxed code execution, remote judges; docs/benchmarks.md) - in chunks
as Prefect tasks on Ray workers through prefect-ray's ``RayTaskRunner`` (``reward_model.reward_manager=ray``).
"""

from __future__ import annotations

import torch
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect_ray import RayTaskRunner
from tensordict import TensorDict

from ppoflow.algorithms.scoring import Scorer, score_responses
from ppoflow.storage.batch import StageResult, last_model_token, non_tensor_column, response_extent
from ppoflow.storage.step_cache.stage_cache import cacheable


def decode_responses(batch: TensorDict, tokenizer) -> list[str]:
    """Each response up to (not including) its final EOS - in a multi-turn trajectory the model's turns
    and the tools' answers, as the model saw them; other special tokens stay visible."""
    lengths = response_extent(batch).tolist()
    texts = []
    for tokens, length in zip(batch["responses"].tolist(), lengths):
        tokens = tokens[:length]
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            tokens = tokens[:-1]
        texts.append(tokens)
    return tokenizer.batch_decode(texts, skip_special_tokens=False)


@task(name="score_chunk", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def score_chunk(data_sources: list[str], solutions: list[str], ground_truths: list,
                custom_scorer: Scorer | None) -> tuple[list[float], dict[str, list[float]]]:
    """Score one chunk of responses (runs in a Ray worker)."""
    return score_responses(data_sources, solutions, ground_truths, custom_scorer)


@flow(name="reward-on-ray", task_runner=RayTaskRunner())  # joins the run's Ray (or RAY_ADDRESS)
def score_on_ray(data_sources: list[str], solutions: list[str], ground_truths: list, custom_scorer: Scorer | None,
                 chunks: int) -> tuple[list[float], dict[str, list[float]]]:
    """Score the responses in ``chunks`` parallel Prefect tasks on Ray workers; same result as in the flow."""
    size = -(-len(solutions) // chunks)
    futures = [score_chunk.submit(data_sources[i:i + size], solutions[i:i + size], ground_truths[i:i + size],
                                  custom_scorer) for i in range(0, len(solutions), size)]
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for part_scores, part_extras in (future.result() for future in futures):
        scores += part_scores
        for name, values in part_extras.items():
            extras.setdefault(name, []).extend(values)
    return scores, extras


@task(name="reward", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
@cacheable
def reward(batch: TensorDict, tokenizer, custom_scorer: Scorer | None, ray_chunks: int = 0) -> StageResult:
    """``token_level_scores`` [N, R] for the batch, plus the mean of any extra value a scorer reported.

    ``ray_chunks`` > 0 scores in that many chunks on Ray workers (:func:`score_on_ray`)."""
    inputs = (non_tensor_column(batch, "data_source"), decode_responses(batch, tokenizer),
              non_tensor_column(batch, "ground_truth"), custom_scorer)
    scores, extras = score_on_ray(*inputs, chunks=ray_chunks) if ray_chunks else score_responses(*inputs)
    mask = batch["response_mask"]
    last_token = last_model_token(mask)
    token_level_scores = torch.zeros(mask.shape, dtype=torch.float32)
    token_level_scores[torch.arange(mask.shape[0]), last_token] = torch.tensor(scores, dtype=torch.float32)
    metrics = {f"reward/{name}/mean": sum(values) / len(values) for name, values in extras.items()}
    return StageResult(TensorDict({"token_level_scores": token_level_scores * mask}, batch_size=batch.batch_size),
                       metrics)
