"""Stage 2, reward: decode each response and score it with its data source's rule (or a custom scorer), combined
with the reward_model stage's score when a model or a reward service scores too (docs/reward_models.md).

The score goes on the response's last valid token (verl's ``token_level_scores``), zero elsewhere; each scorer gets
the row's ``extra_info``. Scoring runs in the flow or, with ``reward_model.reward_manager=ray``, in chunks as Prefect
tasks on Ray workers (prefect-ray's ``RayTaskRunner``, for slow scorers). A response its scorer fails on scores
``custom_reward_function.error_score`` (logged, counted in ``reward/scorer_errors``); a timeout (``on_timeout=fail``)
or a scorer that cannot start fails the stage at once, never retried, naming the scorer, the prompt uid
(``{step}-{i}``, ``val-{row}``), its data source and the task run; ``reward/scorer_timeouts`` counts timeouts scored.
Details: docs/configuration.md#models-data-rewards-resources, docs/reliability.md.
"""

from __future__ import annotations

import torch
from prefect import flow
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect_ray import RayTaskRunner
from tensordict import TensorDict

from ppoflow.algorithms.dynamic_sampling import overlong_penalty
from ppoflow.algorithms.scoring import (
    PRED,
    SCORER_ERRORS,
    SCORER_TIMEOUTS,
    Scorer,
    ScorerFailed,
    combined_scores,
    has_scorer,
    score_responses,
    solution_text,
)
from ppoflow.storage.batch import (
    StageResult,
    last_model_token,
    non_tensor_column,
    response_extent,
    scores_on_last_tokens,
    with_non_tensor_columns,
)
from ppoflow.tasks.task_inputs import recorded_task


def decode_responses(batch: TensorDict, tokenizer) -> list[str]:
    """Each response as its scorer sees it (:func:`solution_text`) - in a multi-turn trajectory the model's
    turns and the tools' answers, as the model saw them."""
    return [
        solution_text(tokens[:length], tokenizer)
        for tokens, length in zip(batch["responses"].tolist(), response_extent(batch).tolist())
    ]


def extra_means(extras: dict[str, list[float]]) -> dict[str, float]:
    """``reward/<name>/mean`` of each extra number the scorers reported (not the text ``pred``), and the counts
    ``reward/scorer_timeouts`` and ``reward/scorer_errors``: how many of the responses scored ``timeout_score``
    or ``error_score`` (:data:`~ppoflow.algorithms.scoring.SCORER_TIMEOUTS`, ``SCORER_ERRORS``)."""
    counted = (SCORER_TIMEOUTS, SCORER_ERRORS)
    metrics = {
        f"reward/{name}/mean": sum(values) / len(values)
        for name, values in extras.items()
        if name not in (*counted, PRED)
    }
    metrics.update({f"reward/{name}": sum(extras[name]) for name in counted if name in extras})
    return metrics


def unless_a_scorer_failed(task, task_run, state) -> bool:
    """Prefect's retry condition: retry any failure but a scorer's."""
    return not isinstance(state.result(raise_on_failure=False), ScorerFailed)


@recorded_task(
    name="score_chunk",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=unless_a_scorer_failed,
)
def score_chunk(
    data_sources: list[str],
    solutions: list[str],
    ground_truths: list,
    custom_scorer: Scorer | None,
    prompt_ids: list[str] | None = None,
    extra_infos: list | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Score one chunk of responses (runs in a Ray worker)."""
    return score_responses(data_sources, solutions, ground_truths, custom_scorer, prompt_ids, extra_infos)


@flow(name="reward-on-ray", task_runner=RayTaskRunner())  # joins the run's Ray (or RAY_ADDRESS)
def score_on_ray(
    data_sources: list[str],
    solutions: list[str],
    ground_truths: list,
    custom_scorer: Scorer | None,
    chunks: int,
    prompt_ids: list[str] | None = None,
    extra_infos: list | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Score the responses in ``chunks`` parallel Prefect tasks on Ray workers; same result as in the flow."""
    size = -(-len(solutions) // chunks)
    futures = [
        score_chunk.submit(
            data_sources[i : i + size],
            solutions[i : i + size],
            ground_truths[i : i + size],
            custom_scorer,
            prompt_ids[i : i + size] if prompt_ids else None,
            extra_infos[i : i + size] if extra_infos else None,
        )
        for i in range(0, len(solutions), size)
    ]
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for part_scores, part_extras in (future.result() for future in futures):
        scores += part_scores
        for name, values in part_extras.items():
            extras.setdefault(name, []).extend(values)
    return scores, extras


@recorded_task(
    name="reward", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1, retry_condition_fn=unless_a_scorer_failed
)
def reward(
    batch: TensorDict,
    tokenizer,
    custom_scorer: Scorer | None,
    ray_chunks: int = 0,
    keep_extras: bool = False,
    combine: str = "sum",
) -> StageResult:
    """``token_level_scores`` [N, R] for the batch, plus the mean of any extra value a scorer reported.

    ``ray_chunks`` > 0 scores in that many chunks on Ray workers (:func:`score_on_ray`). ``keep_extras`` (validation)
    adds each response's extras as the ``reward_extras`` column, as the rollout service returns them when it scores.
    A batch the reward_model stage scored (``rm_scores``) is rule-scored only where a scorer exists, and each
    response's two scores are combined as ``combine`` (``reward_model.combine``) says."""
    sources = non_tensor_column(batch, "data_source")
    model_scores = batch["rm_scores"].tolist() if "rm_scores" in batch.keys() else None
    rows = [row for row, source in enumerate(sources) if model_scores is None or has_scorer(source, custom_scorer)]

    def picked(column: list | None) -> list | None:
        return column if column is None or len(rows) == len(sources) else [column[row] for row in rows]

    solutions = decode_responses(batch, tokenizer)
    inputs = (picked(sources), picked(solutions), picked(non_tensor_column(batch, "ground_truth")), custom_scorer)
    uids = picked(non_tensor_column(batch, "uid"))
    # a step cached before rows carried extra_info has none
    extra_infos = picked(non_tensor_column(batch, "extra_info")) if "extra_info" in batch.keys() else None
    try:
        scores, extras = (
            ([], {})
            if not rows
            else score_on_ray(*inputs, chunks=ray_chunks, prompt_ids=uids, extra_infos=extra_infos)
            if ray_chunks
            else score_responses(*inputs, prompt_ids=uids, extra_infos=extra_infos)
        )
    except ScorerFailed as error:
        context = TaskRunContext.get()
        if context is None:
            raise
        raise type(error)(f"{error} in {context.task_run.name}") from None
    found = response_extras(extras, len(rows)) if keep_extras else []
    if model_scores is not None:
        scores = combined_scores(model_scores, dict(zip(rows, scores)), combine)
        found = [dict(zip(rows, found)).get(row, {}) for row in range(len(sources))] if keep_extras else []
    token_level_scores = scores_on_last_tokens(scores, batch["response_mask"])
    fields = TensorDict({"token_level_scores": token_level_scores}, batch_size=batch.batch_size)
    if keep_extras:
        with_non_tensor_columns(fields, {"reward_extras": found})
    return StageResult(fields, extra_means(extras))


def shape_overlong(batch: TensorDict, overlong, max_resp_len: int) -> StageResult:
    """DAPO's overlong reward shaping (``reward_model.reward_kwargs.overlong_buffer_cfg``): each response's
    :func:`~ppoflow.algorithms.dynamic_sampling.overlong_penalty` added to its score, on its last token, and kept
    as ``overlong_reward`` [N]; with ``log``, ``reward/overlong_reward/mean`` and ``reward/overlong/mean`` (the
    share penalised), verl's names."""
    penalty = overlong_penalty(response_extent(batch), max_resp_len, overlong.len, overlong.penalty_factor)
    mask = batch["response_mask"]
    last = torch.nn.functional.one_hot(last_model_token(mask), mask.shape[1]).to(torch.float32) * mask
    fields = {"token_level_scores": batch["token_level_scores"] + penalty[:, None] * last, "overlong_reward": penalty}
    metrics = {}
    if overlong.log:
        metrics = {
            "reward/overlong_reward/mean": float(penalty.mean()),
            "reward/overlong/mean": float((penalty < 0).float().mean()),
        }
    return StageResult(TensorDict(fields, batch_size=batch.batch_size), metrics)


def response_extras(extras: dict[str, list], count: int) -> list[dict]:
    """The extras of each of ``count`` responses, from one list per extra (as the rollout service returns them). A
    response scored ``error_score`` reported only :data:`~ppoflow.algorithms.scoring.SCORER_ERRORS`, so an extra
    with a value for each of the others belongs to those, in order; one that fits neither way is left out."""
    failed = extras.get(SCORER_ERRORS, [0.0] * count)
    scored = [row for row in range(count) if not failed[row]]
    found: list[dict] = [{} for _ in range(count)]
    for name, values in extras.items():
        rows = range(count) if len(values) == count else scored if len(values) == len(scored) else []
        for row, value in zip(rows, values):
            found[row][name] = value
    return found
