"""The stage declarations (tasks/stages.py) agree with the config's cache keys, the workers' roles and the
caller in flows/stages.py, so a stage added in one place and forgotten in another fails here."""

from __future__ import annotations

import dataclasses
import inspect

from ppoflow.configs.stages import STAGE_CACHE_KEYS, STAGES_WITH_SKIP
from ppoflow.flows.stages import Stages
from ppoflow.tasks.stages import STAGES
from ppoflow.workers.roles import Workers


def test_each_cached_stage_has_the_configs_key_in_step_order():
    assert tuple(stage.skip for stage in STAGES if stage.skip) == STAGE_CACHE_KEYS
    assert set(STAGE_CACHE_KEYS) < set(STAGES_WITH_SKIP)


def test_names_are_unique_and_a_cache_policy_is_only_on_cached_stages():
    assert len({stage.name for stage in STAGES}) == len(STAGES)
    for stage in STAGES:
        assert stage.name == stage.task.name
        if stage.skip is None:
            assert not (stage.matches_input or stage.sampled or stage.weights), stage.name
        else:
            assert stage.matches_input != stage.sampled, stage.name  # a batch to match, or a rollout's identity


def test_a_forward_pass_names_a_role_the_workers_have():
    roles = {field.name for field in dataclasses.fields(Workers)}
    assert {stage.weights for stage in STAGES if stage.weights} <= roles


def test_every_stage_is_called_by_the_caller():
    """Each declared stage is run by a method of :class:`Stages` (whose source names it)."""
    source = inspect.getsource(Stages)
    uncalled = [stage.name for stage in STAGES if stage.name.upper() not in source]
    assert not uncalled, f"stages no Stages method calls: {uncalled}"
