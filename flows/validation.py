"""Validation: generate on the validation set with ``rollout.val_kwargs`` and score it (never cached)."""

from __future__ import annotations

from ppoflow.flows.run import RunContext
from ppoflow.flows.stages import derived_from
from ppoflow.storage.batch import non_tensor_column
from ppoflow.tasks.reward import decode_responses
from ppoflow.workers.rollout import SamplingParams


def validate(run: RunContext, step: int) -> tuple[dict[str, float], list[str]]:
    """``val-core/{data_source}/reward/mean@{n}`` (verl's names) over the validation set, and a few decoded
    samples."""
    sampling = SamplingParams.for_validation(run.cfg)
    val_set, stages = run.val_set, run.stages
    rows = list(range(len(val_set)))
    size = run.cfg.data.val_batch_size or len(rows)
    per_source: dict[str, list[float]] = {}
    samples: list[str] = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        prompts = val_set.batch(chunk, [f"val-{row}" for row in chunk], run.tokenizer.pad_token_id)
        derived_from(val_set, prompts)
        label = f"val@{step}" if len(rows) <= size else f"val@{step}:{start // size}"
        batch = stages.run("generate", run.workers, prompts, step, sampling, label=label, kind="validation").fields
        if "token_level_scores" not in batch.keys():  # not scored while generating
            batch.update(stages.run("reward", batch, run.tokenizer, run.custom_scorer, run.reward_chunks, label=label,
                                    kind="validation").fields)
        sequence_scores = batch["token_level_scores"].sum(dim=1).tolist()
        for source, score in zip(non_tensor_column(batch, "data_source"), sequence_scores):
            per_source.setdefault(source, []).append(score)
        if not samples:
            prompts_text = run.tokenizer.batch_decode(batch["prompts"][:3], skip_special_tokens=True)
            responses = decode_responses(batch[:3], run.tokenizer)
            samples = [f"{p!r} -> {r!r} ({s:.2f})" for p, r, s in zip(prompts_text, responses, sequence_scores)]
    metrics = {f"val-core/{source}/reward/mean@{sampling.n}": sum(scores) / len(scores)
               for source, scores in per_source.items()}
    return metrics, samples


def validation_line(step: int, metrics: dict[str, float], samples: list[str]) -> str:
    """One console line: the validation rewards and a few decoded samples."""
    rewards = ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
    return f"step {step} validation: {rewards}; samples: {', '.join(samples)}"
