"""Shared by tests/test_replay_buffer*.py: hand-made finished groups for the V1 replay buffer."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ppoflow.storage.batch import with_non_tensor_columns

PAD = 99


def make_group(
    token: int, *, n: int = 2, width: int = 3, oldest: list[int] | None = None, newest: list[int] | None = None
) -> TensorDict:
    """A finished group of ``n`` trajectories whose prompt ids are all ``token`` (``width`` of them) and whose
    responses are ``10 * token + session``; weight versions 0 unless given."""
    group = TensorDict(
        {
            "prompts": torch.full((n, width), token, dtype=torch.int64),
            "prompt_mask": torch.ones(n, width, dtype=torch.bool),
            "responses": (10 * token + torch.arange(n)).unsqueeze(1).repeat(1, 4),
            "response_mask": torch.ones(n, 4, dtype=torch.bool),
            "rollout_log_probs": torch.full((n, 4), -0.5),
            "weight_version": torch.tensor(oldest or [0] * n, dtype=torch.int64),
            "max_weight_version": torch.tensor(newest or [0] * n, dtype=torch.int64),
        },
        batch_size=[n],
    )
    return with_non_tensor_columns(
        group, {"data_source": [f"source{token}"] * n, "ground_truth": [{"answer": token}] * n}
    )


def no_poll(interval_s: float) -> None:
    raise AssertionError("sample polled although it had what it needed")
