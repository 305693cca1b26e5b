"""Where a run's caches live and how their storage is opened, from ``skip.<key>`` and the run's shape:
one home for the step caches (built in ``tasks``) and the per-sample cache (built in the rollout
service's workers), which sit in different layers."""

from __future__ import annotations

from ppoflow.configs.schema import PPOConfig, SkipStageConfig
from ppoflow.configs.stages import SAMPLE_CACHE_KEY
from ppoflow.storage.fs import normalize_url
from ppoflow.storage.step_cache.manifest import config_dir


def run_cache_dir(skip: SkipStageConfig, cfg: PPOConfig, *, key: str | None = None) -> str:
    """The run's cache directory under ``skip.dump_dir`` (verl's layout, from the run's shape). The
    per-sample cache (``key`` = ``async_rollout``) caches one prompt's group per entry, so its batch is
    one prompt: verl's ``GBS1`` directory."""
    gbs = 1 if key == SAMPLE_CACHE_KEY else cfg.gen_batch_size
    return config_dir(
        normalize_url(skip.dump_dir),
        experiment_name=cfg.trainer.experiment_name,
        project_name=cfg.trainer.project_name,
        gbs=gbs,
        n=cfg.actor_rollout_ref.rollout.n,
        max_prompt_length=cfg.data.max_prompt_length,
        max_response_length=cfg.data.max_response_length,
    )


def storage_settings(skip: SkipStageConfig) -> dict:
    """fsspec options for ``dump_dir``; s3fs's listings cache off, or another process's keys look missing."""
    options = dict(skip.storage_options)
    if skip.dump_dir.startswith(("s3://", "s3a://")):
        options.setdefault("use_listings_cache", False)
    return options


def entry_size_bound(cfg: PPOConfig, *, prompts: int | None = None) -> int:
    """More bytes than any cache entry of this run can hold (of ``prompts`` prompts; a step's by default):
    every trajectory's prompt and response tokens with 64 bytes each (int64 ids plus every float field a
    stage adds), plus 64 MiB for the payload's JSON header (uids, data sources, ground truths, tool
    errors). A larger entry is refused before it is read."""
    trajectories = (cfg.gen_batch_size if prompts is None else prompts) * cfg.actor_rollout_ref.rollout.n
    tokens = cfg.data.max_prompt_length + cfg.data.max_response_length
    return trajectories * tokens * 64 + (64 << 20)
