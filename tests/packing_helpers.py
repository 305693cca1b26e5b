"""What the packing tests share: the tiny preset with long-tailed responses, a batch of them, the packed keys, the
tolerances, and an update that keeps the weights it made."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ppoflow.configs import load_config

PROMPT, RESPONSE = 8, 24  # the grpo_tiny preset's prompts; responses long enough for a long tail
PACKED = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
FLOAT32 = {"atol": 1e-5, "rtol": 1e-5}
"""Packed and padded rows run the same float32 arithmetic on different tensor shapes (another summation order)."""
WEIGHTS = {"atol": 1e-5, "rtol": 1e-4}
"""Updated weights: AdamW's first step moves each weight by about lr = 1e-3, so 1e-5 is 1% of a step."""


def config(tiny_overrides, *words: str):
    return load_config(
        "grpo_tiny",
        [*tiny_overrides, f"data.max_response_length={RESPONSE}", "algorithm.adv_estimator=gae", *words],
    )


def updated(worker, batch):
    """One update at step 1: its result (the actor's StageResult, the critic's metrics) and the weights after it."""
    result = worker.update(batch, step=1)
    return result, {name: tensor.clone() for name, tensor in worker.model.state_dict().items()}


def long_tailed_batch(prompts: int) -> TensorDict:
    """16 rows with a long tail: most responses of 1-3 tokens, a few of 6-24; ``prompts`` distinct prompts of 1-8
    tokens, left-padded, row i holding prompt i % ``prompts`` (4: four GRPO groups of 4 samples); random tokens of
    the tiny vocabulary; advantages, returns and values for the updates."""
    response_lengths = torch.tensor([1, 1, 2, 1, 3, 1, 2, 1, 6, 1, 1, 2, 11, 1, 3, 24])
    rows = len(response_lengths)
    prompt_lengths = torch.tensor([8, 3, 1, 5, 8, 2, 6, 4, 7, 1, 8, 3, 5, 2, 6, 8])[:prompts].repeat(rows // prompts)
    generator = torch.Generator().manual_seed(0)
    prompt_mask = torch.arange(PROMPT) >= (PROMPT - prompt_lengths).unsqueeze(1)
    response_mask = torch.arange(RESPONSE) < response_lengths.unsqueeze(1)
    prompt_tokens = torch.randint(4, 32, (prompts, PROMPT), generator=generator).repeat(rows // prompts, 1)
    return TensorDict(
        {
            "prompts": prompt_tokens * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": torch.randint(4, 32, (rows, RESPONSE), generator=generator) * response_mask,
            "response_mask": response_mask,
            "advantages": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
            "returns": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
            "values": torch.randn(rows, RESPONSE, generator=generator) * response_mask,
        },
        batch_size=[rows],
    )
