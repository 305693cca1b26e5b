"""Every stage of a PPO step, declared once: its task, its names (``configs.stages``), and the worker
whose weights its result depends on; and the run's step caches, built from ``skip.<stage>``."""

from __future__ import annotations

from dataclasses import dataclass

from prefect import Task

from ppoflow.configs.schema import PPOConfig, SkipStageConfig
from ppoflow.configs.stages import STAGE_NAMES, StageNames
from ppoflow.storage.fs import normalize_url
from ppoflow.storage.step_cache import config_dir
from ppoflow.storage.step_cache.stage_cache import StageCache
from ppoflow.tasks.advantage import advantage
from ppoflow.tasks.generate import generate
from ppoflow.tasks.log_prob import old_log_prob, ref_log_prob
from ppoflow.tasks.reward import reward
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


STAGES = {stage.name: stage for stage in (
    Stage(STAGE_NAMES["generate"], generate),
    Stage(STAGE_NAMES["reward"], reward),
    Stage(STAGE_NAMES["old_log_prob"], old_log_prob, weights="actor"),
    Stage(STAGE_NAMES["ref_log_prob"], ref_log_prob, weights="ref"),
    Stage(STAGE_NAMES["values"], values, weights="critic"),
    Stage(STAGE_NAMES["advantage"], advantage),
    Stage(STAGE_NAMES["update_critic"], update_critic),
    Stage(STAGE_NAMES["update_actor"], update_actor),
    Stage(STAGE_NAMES["weight_sync"], weight_sync),
)}


def run_cache_dir(skip: SkipStageConfig, cfg: PPOConfig) -> str:
    """The run's cache directory under ``skip.dump_dir`` (verl's layout, from the run's shape)."""
    return config_dir(normalize_url(skip.dump_dir), experiment_name=cfg.trainer.experiment_name,
                      project_name=cfg.trainer.project_name, gbs=cfg.gen_batch_size,
                      n=cfg.actor_rollout_ref.rollout.n, max_prompt_length=cfg.data.max_prompt_length,
                      max_response_length=cfg.data.max_response_length)


def storage_settings(skip: SkipStageConfig) -> dict:
    """fsspec options for ``dump_dir``; s3fs's listings cache off, or another process's keys look missing."""
    options = dict(skip.storage_options)
    if skip.dump_dir.startswith(("s3://", "s3a://")):
        options.setdefault("use_listings_cache", False)
    return options


def entry_size_bound(cfg: PPOConfig) -> int:
    """More bytes than any cache entry of this run can hold: every trajectory's prompt and response tokens
    with 64 bytes each (int64 ids plus every float field a stage adds), plus 64 MiB for the payload's
    JSON header (uids, data sources, ground truths). A larger entry is refused before it is read."""
    trajectories = cfg.gen_batch_size * cfg.actor_rollout_ref.rollout.n
    tokens = cfg.data.max_prompt_length + cfg.data.max_response_length
    return trajectories * tokens * 64 + (64 << 20)


def stage_caches(cfg: PPOConfig) -> dict[str, StageCache]:
    """The run's enabled step caches, keyed by stage name."""
    caches = {}
    for stage in STAGES.values():
        skip = cfg.skip.get(stage.names.skip) if stage.names.skip else None
        if skip is not None and skip.enable:
            caches[stage.name] = StageCache(stage.names.skip, normalize_url(skip.dump_dir), run_cache_dir(skip, cfg),
                                            steps=skip.steps, action=skip.action,
                                            storage_options=storage_settings(skip), timeout_s=skip.timeout_s,
                                            retries=skip.retries, allow_mismatch=skip.allow_mismatch,
                                            max_entry_bytes=entry_size_bound(cfg))
    return caches
