"""Every numeric config key has its valid range checked when the config loads, before Prefect or Ray start.

:data:`RANGES` (tests/config_ranges_helpers.py) holds one rule per numeric field of the schema (a section used in
several places, such as ``resources`` or ``optim``, is tried at one of its keys): values just outside the range,
each refused with a problem naming the key and the value, and the boundary values just inside it, which load.
:func:`test_every_numeric_field_has_its_range_tried` keeps the table complete: a new int or float key must
get a rule there, or a place in :data:`OPEN` with the reason its values are all valid. The loader runs in
this process; two cases run the command line, which exits 2 before Ray is started.
"""

from __future__ import annotations

import typing
from typing import Literal

import pytest
from pydantic import BaseModel

from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.schema import PPOConfig, SkipStageConfig
from tests.config_ranges_helpers import OPEN, RANGES


def word(key: str, value) -> str:
    return f"{key}={value}"


def problems_of(words: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config("grpo_tiny", words)
    return caught.value.problems


def expand(message: str) -> str:
    """``>= 1`` is shorthand for pydantic's ``greater than or equal to 1``."""
    return message.replace(">= ", "greater than or equal to ") if message.startswith(">= ") else message


BAD = [
    pytest.param(rule.key, value, expand(fragment), rule.given, id=f"{rule.key}={value}")
    for rule in RANGES
    for value, fragment in rule.bad
]
GOOD = [pytest.param(rule.key, value, rule.given, id=f"{rule.key}={value}") for rule in RANGES for value in rule.good]


@pytest.mark.parametrize("key, value, fragment, given", BAD)
def test_a_value_outside_the_range_is_refused_naming_the_key(key, value, fragment, given):
    problems = problems_of([*given, word(key, value)])
    named = [message for problem_key, message in problems if problem_key == key or problem_key.startswith(f"{key}.")]
    assert any(fragment in message for message in named), problems  # the key, or its list item (betas.0)
    assert len(problems) == 1, problems  # nothing else is blamed for the value


@pytest.mark.parametrize("key, value, given", GOOD)
def test_the_boundary_values_load(key, value, given):
    cfg = load_config("grpo_tiny", [*given, word(key, value)])
    assert cfg is not None


def test_every_bad_value_is_reported_in_one_round():
    """The rules that need no other override, all broken at once: each is reported, none hides another."""
    alone = [(rule.key, value) for rule in RANGES if not rule.given for value, _ in rule.bad[:1]]
    problems = problems_of([word(key, value) for key, value in alone])
    reported = {key for key, _ in problems}
    missing = [key for key, _ in alone if not any(got == key or got.startswith(f"{key}.") for got in reported)]
    assert missing == [] and len(problems) == len(alone), problems


def _numeric(annotation) -> bool:
    """Whether a field holds numbers: int or float, alone or inside Optional, Union, list or dict."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) is Literal:
        return False
    return any(_numeric(argument) for argument in typing.get_args(annotation))


def _sections(annotation) -> list[type[BaseModel]]:
    return [
        argument
        for argument in (annotation, *typing.get_args(annotation))
        if isinstance(argument, type) and issubclass(argument, BaseModel)
    ]


def _owner(model: type[BaseModel], name: str) -> str:
    """``Class.field`` of the class that declares the field (a section reused in several places is one rule)."""
    declaring = next(cls for cls in model.__mro__ if name in vars(cls).get("__annotations__", {}))
    return f"{declaring.__name__}.{name}"


def _numeric_fields(model: type[BaseModel], prefix: str = "", found: dict | None = None) -> dict[str, str]:
    """Each numeric field of the schema, ``Class.field`` -> the first config key that reaches it."""
    found = {} if found is None else found
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if name == "skip" and model is PPOConfig:
            _numeric_fields(SkipStageConfig, "skip.rollout.", found)
        elif _sections(field.annotation):
            _numeric_fields(_sections(field.annotation)[0], f"{key}.", found)
        elif _numeric(field.annotation):
            found.setdefault(_owner(model, name), key)
    return found


def _field_of(key: str) -> str:
    """``Class.field`` that a dotted config key reaches."""
    model, parts = PPOConfig, key.split(".")
    if parts[0] == "skip":
        model, parts = SkipStageConfig, parts[2:]
    for name in parts[:-1]:
        model = _sections(model.model_fields[name].annotation)[0]
    return _owner(model, parts[-1])


def test_every_numeric_field_has_its_range_tried():
    fields = _numeric_fields(PPOConfig)
    assert len(fields) > 80  # the walk reached the whole schema
    tried = [_field_of(rule.key) for rule in RANGES] + [_field_of(key) for key in OPEN]
    assert len(tried) == len(set(tried)), "a field has two rules"
    untried = {field: key for field, key in fields.items() if field not in tried}
    assert untried == {}, "give these keys a rule in RANGES (or a reason in OPEN)"
    assert all(rule.bad and rule.good for rule in RANGES)


@pytest.mark.reliability
@pytest.mark.parametrize("key, value", [("actor_rollout_ref.rollout.top_p", 0.0), ("ray.num_cpus", 1.5)])
def test_the_command_line_refuses_it_before_ray_starts(capsys, monkeypatch, tmp_path, key, value):
    import ray

    from tests.preflight_helpers import DEMO, assert_user_error, run_cli

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a config that does not load")

    monkeypatch.setattr(ray, "init", no_ray)
    code, stderr = run_cli(capsys, *DEMO, word(key, value), f"trainer.default_local_dir={tmp_path}/run")
    assert_user_error(code, stderr, f"  {key}: ", f"(got {value})")
    assert not (tmp_path / "run").exists()


@pytest.mark.reliability
def test_ppoflow_config_lists_every_out_of_range_key(capsys):
    from tests.preflight_helpers import assert_user_error, run_cli

    code, stderr = run_cli(
        capsys, "config", "data.seed=-1", "actor_rollout_ref.actor.clip_ratio_low=0", "skip.rollout.steps=[0]"
    )
    assert_user_error(
        code,
        stderr,
        "(3 problems)",
        "  data.seed: Input should be greater than or equal to 0 (got -1)",
        "  actor_rollout_ref.actor.clip_ratio_low: Input should be greater than 0 (got 0)",
        "  skip.rollout.steps.0: Input should be greater than or equal to 1 (got 0)",
    )
