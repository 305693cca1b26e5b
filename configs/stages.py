"""The stages of a PPO step and their names, written once.

Each stage has one name (its Prefect task, its docs), and two names users see elsewhere that follow
verl where verl has them: its step-cache key (``skip.<skip>.*`` in the config, ``skip/<skip>/*`` in the
metrics; verl calls the generation cache ``skip.rollout``) and its timing metric (``timing_s/<timing>``;
verl's ``gen``, ``ref``, ``adv``, ``update_weights``). Everything that needs one of these names looks
it up here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.storage.step_cache.manifest import ROLLOUT_STAGE, SAMPLE_STAGE


@dataclass(frozen=True)
class StageNames:
    """The names of one stage."""

    name: str
    skip: str | None
    """Step-cache key; None for stages whose result is never cached (updates, weight sync)."""
    timing: str


STAGES = (
    StageNames("generate", skip=ROLLOUT_STAGE, timing="gen"),
    StageNames("sample", skip=None, timing="gen"),
    StageNames("reward", skip="reward", timing="reward"),
    StageNames("old_log_prob", skip="old_log_prob", timing="old_log_prob"),
    StageNames("ref_log_prob", skip="ref", timing="ref"),
    StageNames("values", skip="values", timing="values"),
    StageNames("advantage", skip="advantage", timing="adv"),
    StageNames("update_critic", skip=None, timing="update_critic"),
    StageNames("update_actor", skip=None, timing="update_actor"),
    StageNames("weight_sync", skip=None, timing="update_weights"),
)
"""In the order a step runs them (``sample`` takes the place of ``generate`` in the async modes: the
step's batch from the replay buffer)."""

STAGE_NAMES = {stage.name: stage for stage in STAGES}
SAMPLE_CACHE_KEY = SAMPLE_STAGE
"""verl's ``skip.async_rollout``: the generate stage's trajectories cached per prompt by the rollout service
(``rollout.mode=async``) as each prompt's group finishes, keyed by feed order
(:mod:`ppoflow.storage.step_cache.sample_cache`)."""

STAGES_WITH_SKIP = (*(stage.skip for stage in STAGES if stage.skip), SAMPLE_CACHE_KEY)
"""The keys accepted under ``skip.``: each cached stage's, and the per-sample cache's."""
