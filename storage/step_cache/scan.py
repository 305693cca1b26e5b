"""Every entry under a cache root, for ``ppoflow cache ls|show|rm`` and the regression replay.

The store (and the torch its codec needs) is imported where a scan judges entries, so that the package
can export :func:`scan` without making ``import ppoflow.storage.step_cache.manifest`` pay for torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.storage.fs import StorageError, files_by_directory, join, open_fs, path_problem
from ppoflow.storage.step_cache.manifest import STEP_DIR_NAME, stage_of


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


def check_root(dump_dir: str, storage_options: dict | None = None) -> None:
    """:class:`StorageError` naming ``dump_dir`` unless it is a directory (an S3 prefix holding keys counts):
    missing, a file, a symlink loop, a dangling symlink, a FIFO. :func:`scan` itself lists a missing root as
    empty (a run's cache before its first write); a person inspecting one is told."""
    problem = path_problem(dump_dir, want="directory")
    if problem is None:
        fs, root_path = open_fs(dump_dir, storage_options)
        if not fs.isdir(root_path):
            problem = "is a file, not a directory" if fs.exists(root_path) else "no such directory"
    if problem is not None:
        raise StorageError(dump_dir, problem)


def scan(dump_dir: str, storage_options: dict | None = None, *, verify: bool = False) -> list[CacheEntry]:
    """Every stage entry under ``dump_dir`` (``{project}/{config}/{step}/``), sorted; one listing.

    Validity is cheap by default (each marker decodes and belongs where it lies; the payload has the
    recorded size). ``verify`` also does what a replay's load does to every cheaply valid entry: read
    the whole payload, check its sha256 and decode it, so an entry listed valid is one a run would
    replay. That costs one full read of the cache.
    """
    from ppoflow.storage.step_cache.store import CacheCorrupt, Candidate, StepCache, judge_listed

    fs, root_path = open_fs(dump_dir, storage_options)
    keyed: list[tuple[str, str, Candidate]] = []
    for (project, config, step_dir), files in files_by_directory(fs, root_path, depth=3).items():
        if not STEP_DIR_NAME.fullmatch(step_dir):
            continue
        for stage in {stage for name in files if (stage := stage_of(name)) is not None}:
            keyed.append(
                (project, config, Candidate(join(root_path, project, config, step_dir), int(step_dir), stage, files))
            )
    statuses = judge_listed(fs, [candidate for _, _, candidate in keyed])
    entries = []
    for (project, config, candidate), status in zip(keyed, statuses):
        valid, reason = status.valid, status.reason
        if verify and valid:
            try:
                StepCache(join(dump_dir, project, config), stage=candidate.stage, storage_options=storage_options).load(
                    status.step
                )
            except CacheCorrupt as error:
                valid, reason = False, error.reason
        entries.append(CacheEntry(project, config, candidate.stage, status.step, valid, reason, status.nbytes))
    return sorted(entries, key=lambda entry: (entry.project, entry.config, entry.step, entry.stage))
