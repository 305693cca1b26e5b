"""Shared by tests/test_datasets*.py: a data config, verl-style chat rows, the one ConfigError problem of a call."""

from __future__ import annotations

import pytest

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import DataConfig


def data_config(**changes) -> DataConfig:
    values = dict(
        train_files="unused.parquet",
        val_files=None,
        prompt_key="prompt",
        train_batch_size=4,
        gen_batch_size=None,
        val_batch_size=None,
        max_prompt_length=16,
        max_response_length=4,
        filter_overlong_prompts=False,
        truncation="error",
        seed=1,
        shuffle=True,
        return_raw_chat=True,
        apply_chat_template_kwargs={},
        synthetic=None,
    )
    values.update(changes)
    return DataConfig(**values)


def only_problem(call, *args, **kwargs) -> tuple[str, str]:
    """The one ``(key, message)`` of the :class:`ConfigError` that ``call(*args, **kwargs)`` raises."""
    with pytest.raises(ConfigError) as caught:
        call(*args, **kwargs)
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


def chat_row(content: str, truth, source: str = "synthetic/copy") -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "reward_model": {"style": "rule", "ground_truth": truth},
    }
