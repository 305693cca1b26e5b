"""The entries of one stage under one configuration directory: writing, validity, verl's ``cache`` and
``repeat`` resolution, and verified loading (:class:`StepCache`).

Writes are atomic and retried, and an older marker is removed before its payload changes, so a crash at
any point leaves either the old entry or no valid one. A load reads the payload once, checking its size
first and its sha256 while reading, then decodes safetensors (:mod:`ppoflow.storage.batch`): nothing is
unpickled. Listing a stage is one recursive ``find`` (one paginated LIST on S3) plus one concurrent read
of the markers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from fsspec import AbstractFileSystem
from tensordict import TensorDict

from ppoflow.storage.batch import decode_batch, encode_batch
from ppoflow.storage.fs import (
    StorageError,
    StorageWriteError,
    atomic_write,
    files_by_directory,
    join,
    normalize_url,
    open_fs,
    remove_if_present,
    write_with_retries,
)
from ppoflow.storage.marker import file_entry, read_verified
from ppoflow.storage.step_cache.manifest import (
    ACTIONS,
    OWN_KEYS,
    ROLLOUT_STAGE,
    STAGE_NAME,
    STEP_DIR_NAME,
    STEP_MARKER,
    StepStatus,
    as_step,
    decode_manifest,
    judge,
    manifest_mismatch,
    marker_name,
    payload_entry,
    payload_name,
)

logger = logging.getLogger(__name__)


class CacheCorrupt(StorageError):
    """A cache entry that exists but cannot be trusted; ``path`` is the offending file."""


class CacheWriteError(StorageWriteError):
    """A cache write that still failed after its retries; ``path`` is the file being written."""


class StepCache:
    """The entries of one stage under one configuration directory (see :func:`manifest.config_dir`).

    ``write_retries`` is the number of retries after a failed write, so a write is attempted
    ``write_retries + 1`` times, sleeping ``retry_backoff_s * 2**k`` after the k-th failure.
    """

    def __init__(
        self,
        root: str,
        *,
        stage: str = ROLLOUT_STAGE,
        storage_options: dict | None = None,
        write_retries: int = 3,
        retry_backoff_s: float = 0.5,
    ):
        if not STAGE_NAME.fullmatch(stage):
            raise ValueError(f"stage name {stage!r} must match {STAGE_NAME.pattern}")
        if write_retries < 0 or retry_backoff_s < 0:
            raise ValueError("write_retries and retry_backoff_s must be >= 0")
        self.root = normalize_url(root)
        self.stage = stage
        self.write_retries = write_retries
        self.retry_backoff_s = retry_backoff_s
        self._fs, self._root_path = open_fs(self.root, storage_options)

    def __repr__(self) -> str:
        return f"StepCache({self.root!r}, stage={self.stage!r})"

    # -- locations -------------------------------------------------------------------------

    def step_url(self, step: int) -> str:
        """URL of the step directory (the step as a plain decimal integer)."""
        return join(self.root, str(as_step(step)))

    def payload_url(self, step: int) -> str:
        """URL of this stage's payload for ``step``."""
        return join(self.step_url(step), payload_name(self.stage))

    def marker_url(self, step: int) -> str:
        """URL of this stage's commit marker for ``step``."""
        return join(self.step_url(step), marker_name(self.stage))

    # -- writing ---------------------------------------------------------------------------

    def write_payload(self, step: int, batch: TensorDict, *, meta: dict | None = None) -> dict:
        """Write the payload of ``step`` and return the manifest for :meth:`write_marker`.

        An existing marker of this stage and step is removed first, so the entry reads invalid
        until the new marker is written. ``meta`` adds free (JSON) keys to the manifest.
        """
        step = as_step(step)
        meta = dict(meta or {})
        clashing = sorted(set(meta) & OWN_KEYS)
        if clashing:
            raise ValueError(f"meta must not set the manifest's own keys {clashing}")
        if batch.batch_dims != 1:
            raise ValueError(f"a step batch has one batch dimension, got batch_size {list(batch.batch_size)}")
        data = encode_batch(batch)
        manifest = {
            "format_version": STEP_MARKER.version,
            "files": {payload_name(self.stage): file_entry(data)},
            "stage": self.stage,
            "global_steps": step,
            "num_trajectories": batch.batch_size[0],
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            **meta,
        }
        encode_manifest(manifest)  # a meta value that is not JSON fails here, before any write
        marker_url, payload_url = self.marker_url(step), self.payload_url(step)

        def invalidate_then_write() -> None:
            remove_if_present(self._fs, marker_url)
            atomic_write(self._fs, payload_url, data)

        self._with_retries(payload_url, invalidate_then_write)
        return manifest

    def write_marker(self, step: int, manifest: dict) -> None:
        """Commit ``step`` by writing its marker (atomically, with retries)."""
        data = encode_manifest(manifest)
        problem = manifest_mismatch(decode_manifest(data), as_step(step), self.stage)
        if problem:
            raise ValueError(f"manifest does not belong to {self.marker_url(step)}: {problem}")
        marker_url = self.marker_url(step)
        self._with_retries(marker_url, lambda: atomic_write(self._fs, marker_url, data))

    def write(self, step: int, batch: TensorDict, *, meta: dict | None = None) -> dict:
        """Write the payload, then the marker; return the manifest."""
        manifest = self.write_payload(step, batch, meta=meta)
        self.write_marker(step, manifest)
        return manifest

    def remove(self, step: int) -> None:
        """Remove this stage's entry: marker first (so a half-removed entry reads invalid), then payload.
        This is the only way an entry is deleted: Prefect's record of it is derived from the marker."""
        remove_if_present(self._fs, self.marker_url(step))
        remove_if_present(self._fs, self.payload_url(step))

    # -- reading ---------------------------------------------------------------------------

    def status(self, step: int) -> StepStatus:
        """Cheap validity of ``step``: marker decodes and matches, payload has the recorded size."""
        found = self._inspect(step)
        if found is None:
            return StepStatus(as_step(step), False, f"missing {marker_name(self.stage)}", 0)
        return found

    def steps(self) -> list[StepStatus]:
        """Status of every step directory holding at least one file of this stage, sorted by step.

        Step directories without a file of this stage (another stage's entry, an empty directory,
        a name that is not a canonical integer) are not entries of this stage and are left out.
        """
        candidates = [
            Candidate(join(self._root_path, step_dir), int(step_dir), self.stage, files)
            for (step_dir,), files in files_by_directory(self._fs, self._root_path, depth=1).items()
            if STEP_DIR_NAME.fullmatch(step_dir)
            and (payload_name(self.stage) in files or marker_name(self.stage) in files)
        ]
        return sorted(judge_listed(self._fs, candidates), key=lambda status: status.step)

    def valid_steps(self) -> list[int]:
        """Sorted valid steps; each invalid entry is logged as a warning naming its path."""
        valid = []
        for status in self.steps():
            if status.valid:
                valid.append(status.step)
            else:
                self._warn_invalid(status)
        return valid

    def resolve(self, step: int, action: str) -> int | None:
        """The step whose entry serves ``step`` under ``action``, or None (generate instead).

        ``cache``: ``step`` if valid. ``repeat``: ``step`` if valid, else the largest valid step
        below it, else the smallest valid step above it. Invalid entries are skipped with a warning.
        """
        if action not in ACTIONS:
            raise ValueError(f"unknown cache action {action!r}; expected one of {ACTIONS}")
        exact = self._inspect(step)
        if exact is not None and exact.valid:
            return step
        if action == "cache":
            if exact is not None:
                self._warn_invalid(exact)
            return None
        valid = self.valid_steps()  # warns about the invalid exact entry too
        if step in valid:  # became valid since the check above
            return step
        earlier = [candidate for candidate in valid if candidate < step]
        later = [candidate for candidate in valid if candidate > step]
        if earlier:
            return earlier[-1]
        return later[0] if later else None

    def has_marker(self, step: int) -> bool:
        """Whether ``step`` has this stage's marker, valid or not: an entry was committed there (or something
        took its marker's name). A failing store raises."""
        try:
            self._fs.info(self.marker_url(step))
        except FileNotFoundError:
            return False
        return True

    def manifest(self, step: int) -> dict:
        """The decoded marker of ``step``; an unreadable or foreign one raises :class:`CacheCorrupt`."""
        marker_url = self.marker_url(step)
        try:
            manifest = decode_manifest(self._fs.cat_file(marker_url))
        except FileNotFoundError as error:
            raise CacheCorrupt(marker_url, "missing file") from error
        except (OSError, ValueError) as error:
            raise CacheCorrupt(marker_url, f"unreadable {marker_name(self.stage)}: {error}") from error
        problem = manifest_mismatch(manifest, as_step(step), self.stage)
        if problem:
            raise CacheCorrupt(marker_url, problem)
        return manifest

    def load(self, step: int, *, max_bytes: int | None = None, manifest: dict | None = None) -> tuple[TensorDict, dict]:
        """Read, verify (size, then sha256) and decode an entry; any problem raises :class:`CacheCorrupt`.
        A payload larger than ``max_bytes`` is refused before anything of it is read. ``manifest`` is the
        entry's decoded marker when the caller has read it already (Prefect, replaying the entry)."""
        step = as_step(step)
        if manifest is None:
            manifest = self.manifest(step)
        else:
            problem = manifest_mismatch(manifest, step, self.stage)
            if problem:
                raise CacheCorrupt(self.marker_url(step), problem)
        payload_url = self.payload_url(step)
        payload = read_verified(self._fs, payload_url, payload_entry(manifest), error=CacheCorrupt, max_bytes=max_bytes)
        try:
            batch = decode_batch(payload)
        except ValueError as error:
            raise CacheCorrupt(payload_url, f"undecodable payload: {error}") from error
        if batch.batch_size[0] != manifest["num_trajectories"]:
            raise CacheCorrupt(
                payload_url, f"payload has {batch.batch_size[0]} trajectories, {manifest['num_trajectories']} recorded"
            )
        return batch, manifest

    # -- internals -------------------------------------------------------------------------

    def _inspect(self, step: int) -> StepStatus | None:
        """Status of ``step`` from its marker's bytes and its payload's size; None when neither exists."""
        step = as_step(step)
        marker: bytes | OSError | None
        try:
            marker = self._fs.cat_file(self.marker_url(step), start=0)  # start=0: see judge_listed
        except FileNotFoundError:
            marker = None
        except OSError as error:
            marker = error
        try:
            payload_size = self._fs.size(self.payload_url(step))
        except FileNotFoundError:
            payload_size = None
        if marker is None and payload_size is None:
            return None
        return judge(step, self.stage, marker, payload_size)

    def _warn_invalid(self, status: StepStatus) -> None:
        logger.warning("skipping invalid %s cache entry %s: %s", self.stage, self.step_url(status.step), status.reason)

    def _with_retries(self, url: str, write: Callable[[], None]) -> None:
        """Run ``write``, retrying failures; raise :class:`CacheWriteError` once retries are spent."""
        write_with_retries(
            url, write, retries=self.write_retries, backoff_s=self.retry_backoff_s, error=CacheWriteError
        )


def encode_manifest(manifest: dict) -> bytes:
    """A manifest's bytes: the marker as Prefect persists it (see :mod:`.prefect`)."""
    return STEP_MARKER.encode(
        manifest["files"], **{key: value for key, value in manifest.items() if key not in ("format_version", "files")}
    )


@dataclass(frozen=True)
class Candidate:
    """A stage entry seen in a listing: its step directory path and that directory's file sizes."""

    step_path: str
    step: int
    stage: str
    files: dict[str, int]


def judge_listed(fs: AbstractFileSystem, candidates: list[Candidate]) -> list[StepStatus]:
    """Statuses of listed ``candidates``, reading all their markers in one (concurrent on S3) call."""
    marker_paths = [
        join(candidate.step_path, marker_name(candidate.stage))
        for candidate in candidates
        if marker_name(candidate.stage) in candidate.files
    ]
    # cat_ranges, unlike cat, reads the paths literally (no glob expansion of "[", "*", "?"), and
    # start=0 makes s3fs send one ranged GET per marker instead of a HEAD (for its size) and a GET.
    contents = iter(fs.cat_ranges(marker_paths, 0, None, on_error="return") if marker_paths else [])
    return [
        judge(
            candidate.step,
            candidate.stage,
            next(contents) if marker_name(candidate.stage) in candidate.files else None,
            candidate.files.get(payload_name(candidate.stage)),
        )
        for candidate in candidates
    ]
