"""Shared by tests/test_config*.py: the ConfigError problems of a load, each also in the message."""

from __future__ import annotations

import pytest

from ppoflow.configs import ConfigError, load_config


def problems_of(config: str | None, overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config(config, overrides)
    assert len(caught.value.problems) >= 1
    # the message of the exception lists every problem as "key: message"
    for key, message in caught.value.problems:
        assert f"  {key}: {message}" in str(caught.value)
    return caught.value.problems


def only_problem(overrides: list[str], config: str | None = "grpo_tiny") -> tuple[str, str]:
    problems = problems_of(config, overrides)
    assert len(problems) == 1, problems
    return problems[0]
