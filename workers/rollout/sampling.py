"""Sampling a step's responses: the sampling settings (:class:`SamplingParams`), the seeds (one per step, one per
trajectory) and :func:`sample_responses`, which the transformers rollout worker
(:mod:`ppoflow.workers.rollout.hf_worker`) and the colocated actor (``actor_rollout_ref.hybrid_engine``) run on their
models through the continuous-batching engine (:mod:`ppoflow.workers.rollout.serving`), so a finished response leaves
the batch at once and each trajectory draws from its own seeded stream (its tokens depend on its seed and the
weights, not on its neighbours). :func:`sampled_batch` lays any engine's token lists out as the rollout part of the
step batch (see :mod:`ppoflow.storage.batch`): response tokens, the response mask (up to and including the first EOS),
each sampled token's log-probability under ``softmax(logits / temperature)`` (verl's convention: top-k/top-p
truncation is not folded in, so the actor recomputes exactly the same quantity) and the weight version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tensordict import TensorDict

from ppoflow.configs.schema import PPOConfig
from ppoflow.workers.rollout.requests import RequestSampling, TokenOutput
from ppoflow.workers.rollout.serving import ContinuousBatchingEngine


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` responses per prompt, at most ``max_new_tokens`` each."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool
    max_new_tokens: int
    seed: int

    @classmethod
    def for_training(cls, cfg: PPOConfig) -> SamplingParams:
        rollout = cfg.actor_rollout_ref.rollout
        return cls(
            rollout.n,
            rollout.temperature,
            rollout.top_p,
            rollout.top_k,
            rollout.do_sample,
            cfg.data.max_response_length,
            rollout.seed,
        )

    @classmethod
    def for_validation(cls, cfg: PPOConfig) -> SamplingParams:
        val = cfg.actor_rollout_ref.rollout.val_kwargs
        return cls(
            val.n,
            val.temperature,
            val.top_p,
            val.top_k,
            val.do_sample,
            cfg.data.max_response_length,
            cfg.actor_rollout_ref.rollout.seed,
        )

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def as_dict(self) -> dict:
        return asdict(self)


def step_seed(seed: int, step: int) -> int:
    """A sampling seed that depends only on ``(seed, step)``: replays and resumes sample identically."""
    return _seed(f"{seed}/{step}")


def trajectory_seed(seed: int, step: int, position: int, sample: int) -> int:
    """The sampling seed of one trajectory (sample ``sample`` of the prompt at ``position``): depends only on the
    run's seed, the step and the trajectory's place in the batch, so replays and resumes sample the same whatever
    the scheduling."""
    return _seed(f"{seed}/{step}/{position}/{sample}")


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % (2**63)


def prompt_token_ids(prompts: TensorDict) -> list[list[int]]:
    """Each prompt's tokens without its left padding."""
    return [row[mask].tolist() for row, mask in zip(prompts["prompts"], prompts["prompt_mask"].bool())]


def sample_responses(
    model,
    tokenizer,
    prompts: TensorDict,
    *,
    step: int,
    sampling: SamplingParams,
    weight_version: int,
    device: torch.device,
) -> TensorDict:
    """Sample ``sampling.n`` responses per prompt on the continuous-batching engine; the rollout part of the step
    batch, rows prompt-major (p0 s0..s(n-1), p1 ...), stamped with ``weight_version``. Trajectory ``(p, s)``
    samples with :func:`trajectory_seed` (greedy: argmax, log-probs at temperature 1 as the engine's)."""
    ids = prompt_token_ids(prompts)
    outputs = sample_trajectories(
        model, ids, range(len(ids)), step=step, sampling=sampling, eos_token_id=tokenizer.eos_token_id, device=device
    )
    return outputs_batch(prompts, sampling, outputs, weight_version=weight_version, tokenizer=tokenizer)


def sample_trajectories(
    model,
    prompt_ids: Sequence[Sequence[int]],
    positions: Sequence[int],
    *,
    step: int,
    sampling: SamplingParams,
    eos_token_id: int,
    device: torch.device,
) -> list[TokenOutput]:
    """The ``sampling.n`` trajectories of each prompt, prompt-major, sampled together on the continuous-batching
    engine. ``prompt_ids[i]`` stands at ``positions[i]`` of the step's batch, which seeds its trajectories
    (:func:`trajectory_seed`): a share of the batch samples the tokens the whole batch would (a colocated rank's)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):  # its LoRA layers live in the base model, which the engine drives
        model = model.get_base_model()
    engine = ContinuousBatchingEngine(
        model, eos_token_id=eos_token_id, device=device, max_num_seqs=max(1, len(prompt_ids) * sampling.n)
    )
    futures = [
        engine.submit(
            f"{position}/{sample}",
            ids,
            RequestSampling(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                greedy=sampling.greedy,
                max_new_tokens=sampling.max_new_tokens,
                seed=trajectory_seed(sampling.seed, step, position, sample),
            ),
        )
        for position, ids in zip(positions, prompt_ids)
        for sample in range(sampling.n)
    ]
    while engine.step():
        pass
    return [future.result() for future in futures]


def outputs_batch(
    prompts: TensorDict, sampling: SamplingParams, outputs: Sequence[TokenOutput], *, weight_version: int, tokenizer
) -> TensorDict:
    """:func:`sampled_batch` of the engine's outputs (``sampling.n`` per prompt, prompt-major)."""
    return sampled_batch(
        prompts,
        sampling,
        [output.token_ids for output in outputs],
        [output.log_probs for output in outputs],
        weight_version=weight_version,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def sampled_batch(
    prompts: TensorDict,
    sampling: SamplingParams,
    token_ids: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    *,
    weight_version: int,
    eos_token_id: int,
    pad_token_id: int,
) -> TensorDict:
    """The rollout part of the step batch from an engine's ``sampling.n`` token lists per prompt (prompt-major) and
    their log-probs: each prompt's tensors repeated ``n`` times, the response fields (:func:`rollout_batch`), the
    weight version and each row's group (its prompt)."""
    # the prompt tensors only: any per-prompt column sent along stays with the driver, which repeats
    # its own copy onto the responses (tasks/generate.py)
    count = prompts.batch_size[0]
    group_index = torch.arange(count).repeat_interleave(sampling.n)
    repeated = prompts.select("prompts", "prompt_mask")[group_index]
    repeated.update(
        {
            **rollout_batch(
                token_ids,
                log_probs,
                width=sampling.max_new_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
            ),
            "weight_version": torch.full((count * sampling.n,), weight_version, dtype=torch.int64),
            "group_index": group_index,
        }
    )
    return repeated


def rollout_batch(
    token_ids: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    *,
    width: int,
    eos_token_id: int,
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """The response fields of the step batch from per-trajectory token ids and their log-probs.

    Every engine's layout: ``responses`` [N, width] int64, right-padded with ``pad_token_id``;
    ``response_mask`` [N, width] bool, True up to and including the first EOS; ``rollout_log_probs``
    [N, width] float32, zero wherever the mask is False. Tokens after the first EOS (an engine stops
    there, so normally there are none) are masked and replaced by padding.
    """
    if len(token_ids) != len(log_probs):
        raise ValueError(f"{len(token_ids)} token lists but {len(log_probs)} log-prob lists")
    padded_tokens, padded_scores, valid_lengths = [], [], []
    for row, (tokens, scores) in enumerate(zip(token_ids, log_probs)):
        tokens, scores = list(tokens), list(scores)
        if len(tokens) != len(scores):
            raise ValueError(f"row {row}: {len(tokens)} tokens but {len(scores)} log-probs")
        if len(tokens) > width:
            raise ValueError(f"row {row}: {len(tokens)} tokens exceed the response width {width}")
        valid = tokens.index(eos_token_id) + 1 if eos_token_id in tokens else len(tokens)
        padded_tokens.append(tokens[:valid] + [pad_token_id] * (width - valid))
        padded_scores.append(scores[:valid] + [0.0] * (width - valid))
        valid_lengths.append(valid)
    rows = len(token_ids)
    return {
        "responses": torch.tensor(padded_tokens, dtype=torch.int64).view(rows, width),
        "response_mask": torch.arange(width) < torch.tensor(valid_lengths, dtype=torch.int64).view(rows, 1),
        "rollout_log_probs": torch.tensor(padded_scores, dtype=torch.float32).view(rows, width),
    }
