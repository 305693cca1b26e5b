"""Shared by the step cache's tests (tests/test_step_cache*.py, tests/test_cli.py): a step batch with every
rollout field, its comparison, and the settings of the cache under test. The ``root`` and ``cache`` fixtures
are in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from ppoflow.storage.batch import NON_TENSOR_FIELDS, non_tensor_column, with_non_tensor_columns
from ppoflow.storage.step_cache import StepCache

REPO_ROOT = Path(__file__).resolve().parents[1]
BUCKET = "ppoflow-test"  # created by the s3_server fixture
CONFIG = dict(experiment_name="ut_exp", project_name="ut_proj", gbs=4, n=2, max_prompt_length=8, max_response_length=16)
CACHE_LOGGER = "ppoflow.storage.step_cache"


def make_batch(uids: list[str], seed: int = 0, prompt_length: int = 3, response_length: int = 4) -> TensorDict:
    """A small step batch with every rollout field; ``prompts[:, 0]`` holds the row number."""
    rows = len(uids)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 1000, (rows, prompt_length), generator=generator)
    prompts[:, 0] = torch.arange(rows)
    first_seen = list(dict.fromkeys(uids))
    batch = TensorDict(
        {
            "prompts": prompts,
            "prompt_mask": torch.rand(rows, prompt_length, generator=generator) > 0.2,
            "responses": torch.randint(0, 1000, (rows, response_length), generator=generator),
            "response_mask": torch.rand(rows, response_length, generator=generator) > 0.2,
            "rollout_log_probs": -torch.rand(rows, response_length, generator=generator),
            "weight_version": torch.full((rows,), 3, dtype=torch.int64),
            "group_index": torch.tensor([first_seen.index(uid) for uid in uids], dtype=torch.int64),
        },
        batch_size=[rows],
    )
    return with_non_tensor_columns(
        batch,
        {
            "uid": uids,
            "data_source": ["gsm8k" if row % 2 else "math" for row in range(rows)],
            "ground_truth": [
                {"answer": str(row), "steps": [row, seed]} if row % 2 else str(row) for row in range(rows)
            ],
        },
    )


def assert_same_batch(actual: TensorDict, expected: TensorDict) -> None:
    assert set(actual.keys()) == set(expected.keys())
    assert actual.batch_size == expected.batch_size
    for name in expected.keys():
        if name in NON_TENSOR_FIELDS:
            assert non_tensor_column(actual, name) == non_tensor_column(expected, name), name
        else:
            assert actual[name].dtype == expected[name].dtype, name
            assert torch.equal(actual[name], expected[name]), name


def write_steps(cache: StepCache, steps: list[int]) -> None:
    for step in steps:
        cache.write(step, make_batch(["a", "a", "b", "b"], seed=step))


def warnings_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in caplog.records if record.name.startswith(CACHE_LOGGER))
