"""The per-step cache of stage outputs (rollouts first), on any fsspec storage.

It re-implements verl's SkipManager rollout cache (``cache`` and ``repeat`` replay) with the same
directory layout, and fixes what verl leaves unsafe:

* Layout: ``{dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{P}_out{R}/{step}/``. In a step
  directory each stage has a payload (``{stage}.safetensors``) and a commit marker written last
  (``meta.json`` for the ``rollout`` stage, as in verl; ``{stage}.meta.json`` for the others).
* The marker is a manifest holding the payload's size and sha256, so a truncated, replaced or
  half-written payload reads invalid (cheaply, by size) or fails to load (by checksum) with
  :class:`CacheCorrupt`. Payloads are safetensors (:mod:`storage.batch`); nothing is unpickled.
* Writes are atomic (:func:`storage.fs.atomic_write`), retried, and invalidate an older marker
  before the payload changes, so a crash at any point leaves either the old entry or no valid one.
* A step directory counts only if its name is the canonical decimal spelling of an integer
  (``7``, ``-3``, ``0``; not ``007``, ``+7`` or `` 7``), i.e. exactly what :meth:`StepCache.step_url`
  writes. verl's ``int()`` leniency would let ``007`` stand for step 7 while ``status(7)`` looks at ``7/``.
* Listing is one recursive ``find`` (one paginated LIST on S3) plus one concurrent read of the markers.

It also holds verl's V1 uid remapping that fits a cached step onto the current step's prompts
(:func:`remap_to_prompts`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
from fsspec import AbstractFileSystem
from tensordict import TensorDict

from ppoflow.storage.batch import decode_batch, encode_batch, non_tensor_column, with_non_tensor_columns
from ppoflow.storage.fs import (StorageError, StorageWriteError, atomic_write, join, normalize_url, open_fs, read_with_sha256,
                        write_with_retries)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ROLLOUT_STAGE = "rollout"
ACTIONS = ("cache", "repeat")

_PAYLOAD_SUFFIX = ".safetensors"
_MARKER_SUFFIX = ".meta.json"
_ROLLOUT_MARKER = "meta.json"  # verl's marker name, kept for the rollout stage
_STEP_DIR_NAME = re.compile(r"0|-?[1-9][0-9]*")
_STAGE_NAME = re.compile(r"[A-Za-z0-9_-]+")
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")
_MANIFEST_TYPES: dict[str, type] = {
    "format_version": int,
    "stage": str,
    "global_steps": int,
    "num_trajectories": int,
    "payload": str,
    "payload_bytes": int,
    "checksum": str,
    "created_at": str,
}


class CacheCorrupt(StorageError):
    """A cache entry that exists but cannot be trusted; ``path`` is the offending file."""


class CacheWriteError(StorageWriteError):
    """A cache write that still failed after its retries; ``path`` is the file being written."""


@dataclass(frozen=True)
class StepStatus:
    """Cheap validity of one stage entry. ``nbytes`` is the payload's size on storage (0 if absent)."""

    step: int
    valid: bool
    reason: str
    nbytes: int


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


def config_dir(
    dump_dir: str,
    *,
    experiment_name: str,
    project_name: str,
    gbs: int,
    n: int,
    max_prompt_length: int,
    max_response_length: int,
) -> str:
    """URL of the cache directory of one run configuration (verl's ``project_dir``)."""
    project = f"{experiment_name}_{project_name}"
    if "/" in project:
        raise ValueError(f"experiment and project names must not contain '/': {project!r}")
    config = f"GBS{gbs}_N{n}_in{max_prompt_length}_out{max_response_length}"
    return join(normalize_url(dump_dir), project, config)


def payload_name(stage: str) -> str:
    """File name of a stage's payload inside a step directory."""
    return f"{stage}{_PAYLOAD_SUFFIX}"


def marker_name(stage: str) -> str:
    """File name of a stage's commit marker inside a step directory."""
    return _ROLLOUT_MARKER if stage == ROLLOUT_STAGE else f"{stage}{_MARKER_SUFFIX}"


def parse_marker_key(key: str) -> tuple[str, int, str]:
    """``(config directory, step, stage)`` of a marker path ``{config directory}/{step}/{marker}``.

    Raises ``ValueError`` unless the step directory is a canonical integer and the file name is a
    marker name (see :func:`marker_name`)."""
    config_path, _, rest = key.strip("/").rpartition("/")
    config_path, _, step_dir = config_path.rpartition("/")
    stage = _stage_of(rest)
    if not _STEP_DIR_NAME.fullmatch(step_dir) or stage is None or marker_name(stage) != rest:
        raise ValueError(f"{key!r} is not a step-cache marker path ({{config}}/{{step}}/{{marker}})")
    return config_path, int(step_dir), stage


class StepCache:
    """The entries of one stage under one configuration directory (see :func:`config_dir`).

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
        if not _STAGE_NAME.fullmatch(stage):
            raise ValueError(f"stage name {stage!r} must match {_STAGE_NAME.pattern}")
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
        return join(self.root, str(_as_step(step)))

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
        step = _as_step(step)
        meta = dict(meta or {})
        clashing = sorted(set(meta) & set(_MANIFEST_TYPES))
        if clashing:
            raise ValueError(f"meta must not set the manifest's own keys {clashing}")
        if batch.batch_dims != 1:
            raise ValueError(f"a step batch has one batch dimension, got batch_size {list(batch.batch_size)}")
        data = encode_batch(batch)
        manifest = {
            "format_version": FORMAT_VERSION,
            "stage": self.stage,
            "global_steps": step,
            "num_trajectories": batch.batch_size[0],
            "payload": payload_name(self.stage),
            "payload_bytes": len(data),
            "checksum": _sha256(data),
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **meta,
        }
        self.encode_manifest(manifest)  # a meta value that is not JSON fails here, before any write
        marker_url, payload_url = self.marker_url(step), self.payload_url(step)

        def invalidate_then_write() -> None:
            _remove_if_present(self._fs, marker_url)
            atomic_write(self._fs, payload_url, data)

        self._with_retries(payload_url, invalidate_then_write)
        return manifest

    @staticmethod
    def encode_manifest(manifest: dict) -> bytes:
        """Serialise a manifest as UTF-8 JSON with sorted keys."""
        return json.dumps(manifest, sort_keys=True, ensure_ascii=False).encode("utf-8")

    @staticmethod
    def decode_manifest(data: bytes) -> dict:
        """Parse and validate a manifest; ``ValueError`` says what is wrong."""
        manifest = json.loads(data)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if not isinstance(manifest, dict):
            raise ValueError(f"manifest is a JSON {type(manifest).__name__}, not an object")
        missing = [key for key in _MANIFEST_TYPES if key not in manifest]
        if missing:
            raise ValueError(f"manifest lacks {missing}")
        for key, expected in _MANIFEST_TYPES.items():
            value = manifest[key]
            if isinstance(value, bool) or not isinstance(value, expected):
                raise ValueError(f"manifest {key!r} is {value!r}, expected {expected.__name__}")
        if manifest["format_version"] != FORMAT_VERSION:
            raise ValueError(f"unsupported format_version {manifest['format_version']} (expected {FORMAT_VERSION})")
        if manifest["payload_bytes"] < 0 or manifest["num_trajectories"] < 0:
            raise ValueError("manifest sizes must be >= 0")
        if not _CHECKSUM.fullmatch(manifest["checksum"]):
            raise ValueError(f"manifest checksum {manifest['checksum']!r} is not sha256:<64 hex digits>")
        return manifest

    def write_marker(self, step: int, manifest: dict) -> None:
        """Commit ``step`` by writing its marker (atomically, with retries)."""
        data = self.encode_manifest(manifest)
        problem = _manifest_mismatch(self.decode_manifest(data), _as_step(step), self.stage)
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
        """Remove this stage's entry: marker first (so a half-removed entry reads invalid), then payload."""
        _remove_if_present(self._fs, self.marker_url(step))
        _remove_if_present(self._fs, self.payload_url(step))

    # -- reading ---------------------------------------------------------------------------

    def status(self, step: int) -> StepStatus:
        """Cheap validity of ``step``: marker decodes and matches, payload has the recorded size."""
        found = self._inspect(step)
        if found is None:
            return StepStatus(_as_step(step), False, f"missing {marker_name(self.stage)}", 0)
        return found

    def steps(self) -> list[StepStatus]:
        """Status of every step directory holding at least one file of this stage, sorted by step.

        Step directories without a file of this stage (another stage's entry, an empty directory,
        a name that is not a canonical integer) are not entries of this stage and are left out.
        """
        candidates = [
            _Candidate(join(self._root_path, step_dir), int(step_dir), self.stage, files)
            for (step_dir,), files in _files_by_directory(self._fs, self._root_path, depth=1).items()
            if _STEP_DIR_NAME.fullmatch(step_dir)
            and (payload_name(self.stage) in files or marker_name(self.stage) in files)
        ]
        statuses = _judge(self._fs, candidates)
        return sorted(statuses, key=lambda status: status.step)

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

    def manifest(self, step: int) -> dict:
        """The decoded marker of ``step``; an unreadable or foreign one raises :class:`CacheCorrupt`."""
        marker_url = self.marker_url(step)
        try:
            manifest = self.decode_manifest(_read(self._fs, marker_url))
        except ValueError as error:
            raise CacheCorrupt(marker_url, f"unreadable {marker_name(self.stage)}: {error}") from error
        problem = _manifest_mismatch(manifest, _as_step(step), self.stage)
        if problem:
            raise CacheCorrupt(marker_url, problem)
        return manifest

    def load(self, step: int) -> tuple[TensorDict, dict]:
        """Read, verify (size and sha256) and decode an entry; any problem raises :class:`CacheCorrupt`."""
        step = _as_step(step)
        manifest = self.manifest(step)
        payload_url = self.payload_url(step)
        with _reading(payload_url):
            payload, digest = read_with_sha256(self._fs, payload_url)
        if len(payload) != manifest["payload_bytes"]:
            raise CacheCorrupt(payload_url, f"payload size {len(payload)} != {manifest['payload_bytes']} recorded")
        checksum = f"sha256:{digest}"
        if checksum != manifest["checksum"]:
            raise CacheCorrupt(payload_url, f"payload checksum {checksum} != {manifest['checksum']} recorded")
        try:
            batch = decode_batch(payload)
        except Exception as error:  # the decoder's failure modes vary (ValueError, tensordict errors)
            raise CacheCorrupt(payload_url, f"undecodable payload: {error}") from error
        if batch.batch_size[0] != manifest["num_trajectories"]:
            raise CacheCorrupt(
                payload_url,
                f"payload has {batch.batch_size[0]} trajectories, {manifest['num_trajectories']} recorded",
            )
        return batch, manifest

    # -- internals -------------------------------------------------------------------------

    def _inspect(self, step: int) -> StepStatus | None:
        """Status of ``step`` from its marker's bytes and its payload's size; None when neither exists."""
        step = _as_step(step)
        marker: bytes | OSError | None
        try:
            marker = self._fs.cat_file(self.marker_url(step), start=0)  # start=0: see _judge
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
        return _judge_one(step, self.stage, marker, payload_size)

    def _warn_invalid(self, status: StepStatus) -> None:
        logger.warning(
            "skipping invalid %s cache entry %s: %s", self.stage, self.step_url(status.step), status.reason
        )

    def _with_retries(self, url: str, write: Callable[[], None]) -> None:
        """Run ``write``, retrying failures; raise :class:`CacheWriteError` once retries are spent."""
        write_with_retries(url, write, retries=self.write_retries, backoff_s=self.retry_backoff_s, error=CacheWriteError)


def scan(dump_dir: str, storage_options: dict | None = None, *, verify: bool = False) -> list[CacheEntry]:
    """Every stage entry under ``dump_dir`` (``{project}/{config}/{step}/``), sorted; one listing.

    Validity is cheap by default (each marker decodes and belongs where it lies; the payload has the
    recorded size). ``verify`` also does what a replay's load does to every cheaply valid entry: read
    the whole payload, check its sha256 and decode it, so an entry listed valid is one a run would
    replay. That costs one full read of the cache.
    """
    fs, root_path = open_fs(dump_dir, storage_options)
    keyed: list[tuple[str, str, _Candidate]] = []
    for (project, config, step_dir), files in _files_by_directory(fs, root_path, depth=3).items():
        if not _STEP_DIR_NAME.fullmatch(step_dir):
            continue
        stages = {stage for name in files if (stage := _stage_of(name)) is not None}
        for stage in stages:
            step_path = join(root_path, project, config, step_dir)
            keyed.append((project, config, _Candidate(step_path, int(step_dir), stage, files)))
    statuses = _judge(fs, [candidate for _, _, candidate in keyed])
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


def remap_to_prompts(cached: TensorDict, prompt_uids: list[str], n: int) -> TensorDict:
    """Fit a cached step's trajectories onto the current step's prompts (verl's V1 replay mapping).

    Cached trajectories are grouped by ``uid`` in first-appearance order; prompt ``i`` takes group
    ``i % G`` and its session ``s`` takes the group's trajectory ``s % len(group)``. The result has
    ``len(prompt_uids) * n`` rows, prompt-major, with ``uid`` and ``group_index`` rewritten.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if "uid" not in cached.keys():
        raise ValueError("cached batch has no 'uid' column to group trajectories by")
    groups: dict[str, list[int]] = {}
    for row, uid in enumerate(non_tensor_column(cached, "uid")):
        groups.setdefault(uid, []).append(row)
    if not groups:
        raise ValueError("cached batch holds no trajectory groups")
    group_rows = list(groups.values())
    if len(group_rows) != len(prompt_uids):
        logger.warning(
            "cached step has %d prompt groups but this step has %d prompts; %s",
            len(group_rows),
            len(prompt_uids),
            "cycling through the cached groups" if len(group_rows) < len(prompt_uids) else "using the first groups",
        )
    odd_sizes = sorted({len(rows) for rows in group_rows if len(rows) != n})
    if odd_sizes:
        logger.warning(
            "cached groups of %s trajectories differ from n=%d; cycling or truncating their sessions", odd_sizes, n
        )
    selected: list[int] = []
    for prompt_index in range(len(prompt_uids)):
        rows = group_rows[prompt_index % len(group_rows)]
        selected.extend(rows[session % len(rows)] for session in range(n))
    remapped = cached[torch.tensor(selected, dtype=torch.long)]
    remapped.set("group_index", torch.arange(len(prompt_uids), dtype=torch.int64).repeat_interleave(n))
    return with_non_tensor_columns(remapped, {"uid": [uid for uid in prompt_uids for _ in range(n)]})


# -- module internals ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    """A stage entry seen on storage: its step directory path and that directory's file sizes."""

    step_path: str
    step: int
    stage: str
    files: dict[str, int]


def _as_step(step: int) -> int:
    """``step`` as a plain int; bools and non-integers raise ``TypeError``."""
    if isinstance(step, bool):
        raise TypeError("a step must be an int, not a bool")
    return operator.index(step)


def _sha256(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _stage_of(file_name: str) -> str | None:
    """The stage whose payload or marker is named ``file_name``, if any."""
    if file_name == _ROLLOUT_MARKER:
        return ROLLOUT_STAGE
    for suffix in (_PAYLOAD_SUFFIX, _MARKER_SUFFIX):
        if file_name.endswith(suffix):
            stage = file_name[: -len(suffix)]
            if _STAGE_NAME.fullmatch(stage) and file_name in (payload_name(stage), marker_name(stage)):
                return stage
    return None


def _files_by_directory(fs: AbstractFileSystem, root_path: str, depth: int) -> dict[tuple[str, ...], dict[str, int]]:
    """Files exactly ``depth`` directories below ``root_path``, as {directory parts: {name: size}}.

    One recursive ``find`` without ``maxdepth`` (s3fs turns ``maxdepth`` into one LIST per directory).
    """
    try:
        found = fs.find(root_path, detail=True)
    except FileNotFoundError:
        return {}
    prefix = root_path.rstrip("/") + "/"
    grouped: dict[tuple[str, ...], dict[str, int]] = {}
    for path, info in found.items():
        parts = path[len(prefix) :].split("/") if path.startswith(prefix) else []
        if len(parts) == depth + 1:
            grouped.setdefault(tuple(parts[:-1]), {})[parts[-1]] = info["size"]
    return grouped


def _judge(fs: AbstractFileSystem, candidates: list[_Candidate]) -> list[StepStatus]:
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
        _judge_one(
            candidate.step,
            candidate.stage,
            next(contents) if marker_name(candidate.stage) in candidate.files else None,
            candidate.files.get(payload_name(candidate.stage)),
        )
        for candidate in candidates
    ]


def _judge_one(step: int, stage: str, marker: bytes | Exception | None, payload_size: int | None) -> StepStatus:
    """Cheap validity from the marker's bytes (or its read error, or None if absent) and the payload's size.

    Read errors other than ``OSError`` (e.g. a lost connection) are raised: they say nothing about the entry.
    """
    marker_file, payload_file = marker_name(stage), payload_name(stage)
    nbytes = payload_size or 0

    def invalid(reason: str) -> StepStatus:
        return StepStatus(step, False, reason, nbytes)

    if marker is None or isinstance(marker, FileNotFoundError):  # absent, or removed since the listing
        return invalid(f"missing {marker_file}")
    if isinstance(marker, OSError):
        return invalid(f"unreadable {marker_file}: {marker}")
    if isinstance(marker, Exception):
        raise marker
    try:
        manifest = StepCache.decode_manifest(marker)
    except ValueError as error:
        return invalid(f"unreadable {marker_file}: {error}")
    problem = _manifest_mismatch(manifest, step, stage)
    if problem:
        return invalid(problem)
    if payload_size is None:
        return invalid(f"missing {payload_file}")
    if payload_size != manifest["payload_bytes"]:
        return invalid(f"payload size {payload_size} != {manifest['payload_bytes']} recorded")
    return StepStatus(step, True, "", nbytes)


def _manifest_mismatch(manifest: dict, step: int, stage: str) -> str:
    """Why a decoded manifest does not belong at ``step``/``stage`` ("" when it does)."""
    if manifest["global_steps"] != step:
        return f"marker records global_steps {manifest['global_steps']}, not {step}"
    if manifest["stage"] != stage:
        return f"marker records stage {manifest['stage']!r}, not {stage!r}"
    if manifest["payload"] != payload_name(stage):
        return f"marker names payload {manifest['payload']!r}, not {payload_name(stage)!r}"
    return ""


@contextmanager
def _reading(url: str) -> Iterator[None]:
    """Turn a missing or unreadable file at ``url`` into :class:`CacheCorrupt`."""
    try:
        yield
    except FileNotFoundError as error:
        raise CacheCorrupt(url, "missing file") from error
    except OSError as error:
        raise CacheCorrupt(url, f"unreadable: {error}") from error


def _read(fs: AbstractFileSystem, url: str) -> bytes:
    """Whole file at ``url``; a missing or unreadable file raises :class:`CacheCorrupt`."""
    with _reading(url):
        return fs.cat_file(url)


def _remove_if_present(fs: AbstractFileSystem, url: str) -> None:
    try:
        fs.rm_file(url)
    except FileNotFoundError:
        pass
