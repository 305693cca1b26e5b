"""Every stage of a PPO step, declared once: its task, its names (``configs.stages``), and the worker
whose weights its result depends on; and the run's step caches, built from ``skip.<stage>``."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import Task

from ppoflow.configs.cache_settings import entry_size_bound, run_cache_dir, storage_settings
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.stages import STAGE_NAMES, StageNames
from ppoflow.storage.fs import normalize_url
from ppoflow.storage.step_cache.stage_cache import StageCache
from ppoflow.tasks.advantage import advantage
from ppoflow.tasks.generate import generate
from ppoflow.tasks.log_prob import old_log_prob, ref_log_prob
from ppoflow.tasks.reward import reward
from ppoflow.tasks.sample import sample
from ppoflow.tasks.update import update_actor, update_critic
from ppoflow.tasks.values import values
from ppoflow.tasks.weight_sync import weight_sync


@dataclass(frozen=True)
class Stage:
    """One stage: its Prefect task, its names, and (for a forward pass) the role whose weights the result
    depends on, which is part of a cached result's fingerprint."""

    names: StageNames
    task: Task
    weights: str | None = None

    @property
    def name(self) -> str:
        return self.names.name


STAGES = {
    stage.name: stage
    for stage in (
        Stage(STAGE_NAMES["generate"], generate),
        Stage(STAGE_NAMES["sample"], sample),
        Stage(STAGE_NAMES["reward"], reward),
        Stage(STAGE_NAMES["old_log_prob"], old_log_prob, weights="actor"),
        Stage(STAGE_NAMES["ref_log_prob"], ref_log_prob, weights="ref"),
        Stage(STAGE_NAMES["values"], values, weights="critic"),
        Stage(STAGE_NAMES["advantage"], advantage),
        Stage(STAGE_NAMES["update_critic"], update_critic),
        Stage(STAGE_NAMES["update_actor"], update_actor),
        Stage(STAGE_NAMES["weight_sync"], weight_sync),
    )
}


def stage_caches(cfg: PPOConfig) -> dict[str, StageCache]:
    """The run's enabled step caches, keyed by stage name."""
    caches = {}
    for stage in STAGES.values():
        skip = cfg.skip.get(stage.names.skip) if stage.names.skip else None
        if skip is not None and skip.enable:
            caches[stage.name] = StageCache(
                stage.names.skip,
                normalize_url(skip.dump_dir),
                run_cache_dir(skip, cfg),
                steps=skip.steps,
                action=skip.action,
                storage_options=storage_settings(skip),
                timeout_s=skip.timeout_s,
                retries=skip.retries,
                allow_mismatch=skip.allow_mismatch,
                max_entry_bytes=entry_size_bound(cfg),
            )
    return caches
