"""Sampling responses with transformers' ``generate``: the sampling settings of a step, its seeds, and
:func:`sample_responses`, which the rollout worker (:mod:`ppoflow.workers.rollout.hf_worker`) and the colocated
actor (``actor_rollout_ref.hybrid_engine``) run on their models. Each call returns the rollout part of the step
batch (see :mod:`ppoflow.storage.batch`): response tokens, the response mask (up to and including the first EOS),
the log-probability of every sampled token under the sampling distribution ``softmax(logits / temperature)``
(verl's convention: top-k/top-p truncation is not folded in, so the actor recomputes exactly the same quantity),
and the weight version that produced it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch
from tensordict import TensorDict

from ppoflow.configs.schema import PPOConfig


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
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}".encode()).digest()[:8], "little") % (2**63)


class SampledTokenLogProbs:
    """A logits processor that records the log-prob of each sampled token, at ``temperature``, from the
    model's scores before top-k/top-p (transformers runs the warpers after the processors it is given).

    ``generate`` can return every step's logits instead, [N, T, vocab] - 39 GB in float32 for 128 responses
    of 512 tokens with a 150k vocabulary - of which one number per token is used. Each call sees the token
    sampled from the previous call's scores as the last of ``input_ids``, so only one step's log-softmax is
    kept: [N, vocab]."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.sampled: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        """[N, generated] log-probs of the generated tokens (``sequences``: generate's output)."""
        self._take(sequences[:, -1])
        return (
            torch.stack(self.sampled, dim=1)
            if self.sampled
            else sequences.new_zeros((sequences.shape[0], 0), dtype=torch.float32)
        )

    def _take(self, tokens: torch.Tensor) -> None:
        if self.previous is not None:
            self.sampled.append(self.previous.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self.previous = None


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
    """Sample ``sampling.n`` responses per prompt with transformers' ``generate``; the rollout part of the
    step batch, rows prompt-major (p0 s0..s(n-1), p1 ...), stamped with ``weight_version``."""
    from transformers import LogitsProcessorList

    # the prompt tensors only: any per-prompt column sent along stays with the driver, which repeats
    # its own copy onto the responses (tasks/generate.py)
    repeated = prompts.select("prompts", "prompt_mask")[
        torch.arange(prompts.batch_size[0]).repeat_interleave(sampling.n)
    ]
    eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(step_seed(sampling.seed, step))
    model.eval()
    recorder = SampledTokenLogProbs(sampling.temperature if sampling.temperature > 0 else 1.0)
    with torch.no_grad():
        sequences = model.generate(
            input_ids=repeated["prompts"].to(device),
            attention_mask=repeated["prompt_mask"].long().to(device),
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=max(sampling.top_k, 0) if not sampling.greedy else None,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            logits_processor=LogitsProcessorList([recorder]),
        )
    prompt_length = repeated["prompts"].shape[1]
    generated = sequences[:, prompt_length:].cpu()
    token_log_probs = recorder.log_probs(sequences).cpu()

    rows, width = generated.shape[0], sampling.max_new_tokens
    responses = torch.full((rows, width), tokenizer.pad_token_id, dtype=torch.int64)
    responses[:, : generated.shape[1]] = generated
    is_eos = responses == eos_token_id
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    response_mask = ~after_eos
    response_mask[:, generated.shape[1] :] = False
    rollout_log_probs = torch.zeros((rows, width), dtype=torch.float32)
    rollout_log_probs[:, : generated.shape[1]] = token_log_probs
    rollout_log_probs = rollout_log_probs * response_mask

    repeated.update(
        {
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs,
            "weight_version": torch.full((rows,), weight_version, dtype=torch.int64),
            "group_index": torch.arange(prompts.batch_size[0]).repeat_interleave(sampling.n),
        }
    )
    return repeated
