"""Checking a cache entry before it is replayed: loaded once, checksummed, and matched against what the caller
requires of it (the input it was computed from, how a rollout was sampled).

An :class:`EntryCheck` is plain JSON built by the caller for each replay, so nothing read from a cache configures
how an entry is judged; a failing entry raises :class:`CacheEntryRejected`, whose reason the replay's task run
shows. The Prefect side that calls it is :mod:`ppoflow.flows.cached_stages.records`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pydantic import BaseModel, Field

from ppoflow.storage.batch import StageResult
from ppoflow.storage.step_cache.manifest import decode_manifest, recorded_differences
from ppoflow.storage.step_cache.store import CacheCorrupt, StepCache

logger = logging.getLogger(__name__)


class CacheEntryRejected(Exception):
    """A planned replay refused its entry: damaged, or made from another input or in another way. Raised in
    the replay's task run, which then ends ``Failed``; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def rejection(reason: str) -> CacheEntryRejected:
    """:class:`CacheEntryRejected` for ``reason``, logged first as a warning (on the current task run)."""
    logger.warning("%s; recomputing", reason)
    return CacheEntryRejected(reason)


@dataclass
class StageRecord(StageResult):
    """A stage's result as the step cache persists it: after a dumping run ``fields`` holds the tensors
    and ``manifest`` the committed entry's marker; a replayed record holds the loaded tensors too (a
    record read without an :class:`EntryCheck` has ``fields=None``). ``manifest`` is None when the dump
    failed."""

    manifest: dict | None = None


class EntryCheck(BaseModel):
    """What one replay's entry must pass before Prefect calls its task run ``Cached``, and where to load it.

    ``requires`` must be recorded exactly (the input a stage was computed from), ``identity`` too (how a
    rollout was sampled) unless ``allow_mismatch``; a payload recording more than ``max_bytes`` is refused
    before it is read. Plain JSON values, built by this code for each call: nothing read from the cache
    configures the check."""

    root: str
    stage: str
    step: int
    settings: dict = Field(default_factory=dict)
    requires: dict = Field(default_factory=dict)
    identity: dict = Field(default_factory=dict)
    allow_mismatch: bool = False
    max_bytes: int | None = None

    def load(self, marker: bytes) -> StageRecord:
        """The entry whose marker is ``marker``: its payload read once and verified, and matched against
        this run; :class:`CacheEntryRejected` (logged) for anything that fails."""
        entry = f"cached {self.stage} of step {self.step}"
        entries = StepCache(self.root, stage=self.stage, storage_options=self.settings)
        try:
            fields, manifest = entries.load(self.step, max_bytes=self.max_bytes, manifest=decode_manifest(marker))
        except (CacheCorrupt, ValueError) as error:
            raise rejection(f"{entry} is damaged ({error})") from None
        wrong_input = recorded_differences(self.requires, manifest)
        other_identity = recorded_differences(self.identity, manifest)
        if wrong_input or other_identity:
            differences = f"{entry} does not match this run ({'; '.join(wrong_input + other_identity)})"
            if wrong_input or not self.allow_mismatch:
                raise rejection(differences)
            logger.warning("%s; replaying it anyway (skip.%s.allow_mismatch)", differences, self.stage)
        describe(manifest)
        return StageRecord(fields=fields, metrics=manifest.get("metrics", {}), manifest=manifest)


def describe(manifest: dict) -> None:
    """Log what an entry holds (on the task run that replays it)."""
    versions = manifest.get("weight_version")
    logger.info(
        "cached %s of step %d: %d trajectories, written %s%s",
        manifest["stage"],
        manifest["global_steps"],
        manifest["num_trajectories"],
        manifest["created_at"],
        f", sampled with weight versions {versions['min']}-{versions['max']}" if versions else "",
    )
