"""Validation: generate on the validation set with ``rollout.val_kwargs`` and score it (never cached).

Its metrics are verl's, per data source, over each prompt's ``val_kwargs.n`` responses, of the reward and of each
extra value the scorer reports (:mod:`ppoflow.algorithms.validation_metrics`). A few decoded samples go to the
console, the flow run's logs and a table artifact of the task run that scored them; a multi-turn sample in which
a tool answered shows its turns one by one (the model's, and the tools' answers, as the model saw them).
"""

from __future__ import annotations

from itertools import groupby

from ppoflow.algorithms.scoring import PRED, solution_text
from ppoflow.algorithms.validation_metrics import validation_metrics
from ppoflow.flows.artifacts import publish_validation_samples
from ppoflow.flows.run import RunContext
from ppoflow.flows.stages import derived_from, task_run_of
from ppoflow.storage.batch import non_tensor_column, response_extent
from ppoflow.tasks.reward import decode_responses
from ppoflow.workers.rollout.sampling import SamplingParams


def validate(run: RunContext, step: int, rows_of=None) -> tuple[dict[str, float], list[str]]:
    """``val-core/`` and ``val-aux/{data_source}/{variable}/{metric}`` over the validation set
    (:func:`~ppoflow.algorithms.validation_metrics.validation_metrics`), and a few decoded samples
    (:func:`sample_texts`, also a table on the task run that scored them); ``rows_of``, when given, is called
    with each scored batch (the dumps' rows)."""
    sampling = SamplingParams.for_validation(run.cfg)
    val_set, stages = run.val_set, run.stages
    rows = list(range(len(val_set)))
    size = run.cfg.data.val_batch_size or len(rows)
    sources, uids, rewards, extras, samples = [], [], [], [], []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        prompts = val_set.batch(chunk, [f"val-{row}" for row in chunk], run.tokenizer.pad_token_id)
        derived_from(val_set, prompts)
        label = f"val@{step}" if len(rows) <= size else f"val@{step}:{start // size}"
        scored = stages.validation_rollout(step, prompts=prompts, sampling=sampling, label=label)
        batch = scored.fields
        if "token_level_scores" not in batch.keys():  # not scored while generating
            if run.model_reward is not None:
                modelled = stages.validation_reward_model(
                    batch=batch, tokenizer=run.tokenizer, model_reward=run.model_reward, label=label
                )
                batch.update(modelled.fields)
            scored = stages.validation_reward(
                batch=batch,
                tokenizer=run.tokenizer,
                scorer=run.custom_scorer,
                ray_chunks=run.reward_chunks,
                label=label,
                combine=run.cfg.reward_model.combine,
            )
            batch.update(scored.fields)
        sequence_scores = batch["token_level_scores"].sum(dim=1).tolist()
        sources += non_tensor_column(batch, "data_source")
        uids += non_tensor_column(batch, "uid")
        rewards += sequence_scores
        extras += non_tensor_column(batch, "reward_extras")
        if rows_of is not None:
            rows_of(batch)
        if not samples:
            rows = sample_rows(batch[:3], run.tokenizer, sequence_scores)
            samples = [sample_text(row) for row in rows]
            publish_validation_samples(run.cfg, step, rows, task_run_of(scored))
    return validation_metrics(sources, uids, {**extra_columns(extras), "reward": rewards}), samples


def extra_columns(extras: list[dict]) -> dict[str, list]:
    """The responses' extras (one dict each) as one list per extra; a response without it (its scorer failed on
    it: it scored ``error_score``) counts 0, or no answer (None) for ``pred``."""
    names = list(dict.fromkeys(name for found in extras for name in found))
    return {name: [found.get(name, None if name == PRED else 0.0) for found in extras] for name in names}


def sample_texts(batch, tokenizer, scores: list[float]) -> list[str]:
    """``'prompt' -> 'response' (score)`` per trajectory of ``batch`` (:func:`sample_rows`)."""
    return [sample_text(row) for row in sample_rows(batch, tokenizer, scores)]


def sample_text(row: dict) -> str:
    return f"{row['prompt']!r} -> {row['response']} ({row['score']:.2f})"


def sample_rows(batch, tokenizer, scores: list[float]) -> list[dict]:
    """``prompt``, ``response`` (quoted; one in which a tool answered turn by turn, :func:`turn_texts`) and
    ``score`` per trajectory of ``batch``."""
    prompts = tokenizer.batch_decode(batch["prompts"], skip_special_tokens=True)
    responses = [repr(text) for text in decode_responses(batch, tokenizer)]
    if "turn_ids" in batch.keys():
        extents = response_extent(batch).tolist()
        for row, (tokens, turns) in enumerate(zip(batch["responses"].tolist(), batch["turn_ids"].tolist())):
            if any(turn < 0 for turn in turns[: extents[row]]):  # a tool answered (negative turn ids)
                responses[row] = turn_texts(tokens[: extents[row]], turns[: extents[row]], tokenizer)
    return [
        {"prompt": prompt, "response": response, "score": score}
        for prompt, response, score in zip(prompts, responses, scores)
    ]


def turn_texts(tokens: list[int], turn_ids: list[int], tokenizer) -> str:
    """A multi-turn response turn by turn: ``model '?' | tool '58' | model '58'``."""
    return " | ".join(f"{role} {text!r}" for role, text in turn_pieces(tokens, turn_ids, tokenizer))


def turn_pieces(tokens: list[int], turn_ids: list[int], tokenizer) -> list[tuple[str, str]]:
    """A multi-turn response's turns as ``(model|tool, text)`` (``turn_ids``: ``k`` on the model's turn ``k``,
    ``-c`` on the answer to its ``c``-th tool call)."""
    pieces, start = [], 0
    for turn, positions in groupby(turn_ids):
        end = start + len(list(positions))
        pieces.append(("tool" if turn < 0 else "model", solution_text(tokens[start:end], tokenizer)))
        start = end
    return pieces


def validation_line(step: int, metrics: dict[str, float], samples: list[str]) -> str:
    """One console line: the ``val-core/`` metrics but the bootstrap's spreads (``.../std``), and a few decoded
    samples."""
    core = {
        name: value for name, value in metrics.items() if name.startswith("val-core/") and not name.endswith("/std")
    }
    rewards = ", ".join(f"{name} {value:.3f}" for name, value in core.items())
    return f"step {step} validation: {rewards}; samples: {', '.join(samples)}"
