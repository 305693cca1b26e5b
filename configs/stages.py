"""The step-cache keys users write: ``skip.<key>.*`` in the config, ``skip/<key>/*`` in the metrics.

They follow verl where verl has them (its generation cache is ``skip.rollout``). The stages that use them are
declared in :mod:`ppoflow.tasks.stages`; the config layer, below the tasks, knows only the keys.
"""

from __future__ import annotations

from ppoflow.storage.step_cache.manifest import ROLLOUT_STAGE, SAMPLE_STAGE

STAGE_CACHE_KEYS = (ROLLOUT_STAGE, "reward_model", "reward", "old_log_prob", "ref", "values", "advantage")
"""The cache key of each stage whose result a step cache may keep, in the order a step runs them."""

SAMPLE_CACHE_KEY = SAMPLE_STAGE
"""verl's ``skip.async_rollout``: the generate stage's trajectories cached per prompt by the rollout service
(``rollout.mode=async``) as each prompt's group finishes, keyed by feed order
(:mod:`ppoflow.storage.step_cache.sample_cache`)."""

STAGES_WITH_SKIP = (*STAGE_CACHE_KEYS, SAMPLE_CACHE_KEY)
"""The keys accepted under ``skip.``: each cached stage's, and the per-sample cache's."""
