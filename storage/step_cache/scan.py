"""Every entry under a cache root, for ``ppoflow cache ls|show|rm`` and the regression replay."""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.storage.fs import files_by_directory, join, open_fs
from ppoflow.storage.step_cache.manifest import STEP_DIR_NAME, stage_of
from ppoflow.storage.step_cache.store import Candidate, CacheCorrupt, StepCache, judge_listed


@dataclass(frozen=True)
class CacheEntry:
    """One stage entry found by :func:`scan`: ``{dump_dir}/{project}/{config}/{step}/``."""

    project: str
    config: str
    stage: str
    step: int
    valid: bool
    reason: str
    nbytes: int


def scan(dump_dir: str, storage_options: dict | None = None, *, verify: bool = False) -> list[CacheEntry]:
    """Every stage entry under ``dump_dir`` (``{project}/{config}/{step}/``), sorted; one listing.

    Validity is cheap by default (each marker decodes and belongs where it lies; the payload has the
    recorded size). ``verify`` also does what a replay's load does to every cheaply valid entry: read
    the whole payload, check its sha256 and decode it, so an entry listed valid is one a run would
    replay. That costs one full read of the cache.
    """
    fs, root_path = open_fs(dump_dir, storage_options)
    keyed: list[tuple[str, str, Candidate]] = []
    for (project, config, step_dir), files in files_by_directory(fs, root_path, depth=3).items():
        if not STEP_DIR_NAME.fullmatch(step_dir):
            continue
        for stage in {stage for name in files if (stage := stage_of(name)) is not None}:
            keyed.append((project, config, Candidate(join(root_path, project, config, step_dir), int(step_dir),
                                                     stage, files)))
    statuses = judge_listed(fs, [candidate for _, _, candidate in keyed])
    entries = []
    for (project, config, candidate), status in zip(keyed, statuses):
        valid, reason = status.valid, status.reason
        if verify and valid:
            try:
                StepCache(join(dump_dir, project, config), stage=candidate.stage,
                          storage_options=storage_options).load(status.step)
            except CacheCorrupt as error:
                valid, reason = False, error.reason
        entries.append(CacheEntry(project, config, candidate.stage, status.step, valid, reason, status.nbytes))
    return sorted(entries, key=lambda entry: (entry.project, entry.config, entry.step, entry.stage))
