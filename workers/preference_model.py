"""The built-in preference task's reward model (``data.synthetic.task=prefer``): a tiny reward model trained in
seconds to score a property no rule scorer checks - the share of the response budget filled with the letter
``a`` - so that only a model-based reward can teach it (docs/reward_models.md, docs/benchmarks.md).
"""

from __future__ import annotations

import random

import torch

from ppoflow.configs.schema import TinyModelConfig
from ppoflow.workers.models import TINY_CHARACTERS
from ppoflow.workers.remote_reward import RewardSample
from ppoflow.workers.reward_model import build_tiny_reward_model, chat_text, save_reward_model

PREFERRED = "a"
"""The letter the reward model is trained to prefer."""


def preferred_share(response: str, budget: int) -> float:
    """The property the reward model learns: how much of a ``budget``-token response is the letter ``a``."""
    return response.count(PREFERRED) / budget


def _example(rng: random.Random, budget: int) -> tuple[str, str]:
    """A prompt like the task's (two digits and ``>``) and a response of any length up to ``budget``, with any
    share of ``a`` in it."""
    prompt = f"{rng.randrange(10)}{rng.randrange(10)}>"
    share = rng.random()
    length = rng.randint(0, budget)
    response = "".join(PREFERRED if rng.random() < share else rng.choice(TINY_CHARACTERS) for _ in range(length))
    return prompt, response


def train_preference_model(path: str, spec: TinyModelConfig, *, budget: int, steps: int = 400) -> float:
    """Build a tiny reward model into ``path``, train it (``spec.seed``) to regress :func:`preferred_share` of
    random responses, save it; returns its mean absolute error on 512 held-out responses."""
    model, tokenizer = build_tiny_reward_model(path, spec)
    rng = random.Random(spec.seed)
    torch.manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def batch(size: int):
        pairs = [_example(rng, budget) for _ in range(size)]
        rows = [
            tokenizer(chat_text(tokenizer, RewardSample("", "", prompt, response)), add_special_tokens=False)[
                "input_ids"
            ]
            for prompt, response in pairs
        ]
        width = max(len(row) for row in rows)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(row)) + row for row in rows])
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
        target = torch.tensor([preferred_share(response, budget) for _, response in pairs])
        return ids, mask, target

    model.train()
    for _ in range(steps):
        ids, mask, target = batch(64)
        loss = torch.nn.functional.mse_loss(model(input_ids=ids, attention_mask=mask).logits[:, 0], target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        ids, mask, target = batch(512)
        error = float((model(input_ids=ids, attention_mask=mask).logits[:, 0] - target).abs().mean())
    save_reward_model(model, tokenizer, path)
    return error
