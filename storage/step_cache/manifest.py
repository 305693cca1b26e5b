"""The step cache's layout on storage and its commit marker (the *manifest*), as pure functions.

Layout (verl's): ``{dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{P}_out{R}/{step}/`` holding, per stage,
``{stage}.safetensors`` and a marker written last (``meta.json`` for ``rollout``, ``{stage}.meta.json`` otherwise);
a step directory counts only if its name is the canonical decimal spelling of an integer (not ``007``, ``+7``).
The manifest is a :class:`~ppoflow.storage.marker.MarkerFormat` marker listing the payload's size and sha256, plus
stage, step, trajectory count, write time and free metadata. Details: docs/step_cache.md#how-it-works.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

from ppoflow.storage.fs import join, normalize_url
from ppoflow.storage.marker import MarkerFormat, size_problem

ROLLOUT_STAGE = "rollout"
SAMPLE_STAGE = "async_rollout"
"""The stage name of a sample entry's files (``async_rollout.safetensors``, ``async_rollout.meta.json``;
:mod:`.sample_cache`)."""
ACTIONS = ("cache", "repeat")

STEP_MARKER = MarkerFormat(
    version=2, fields={"stage": str, "global_steps": int, "num_trajectories": int, "created_at": str}
)
"""Version 2 lists the payload under ``files`` like every marker (version 1 entries read as invalid
and are regenerated)."""

OWN_KEYS = frozenset({"format_version", "files", *STEP_MARKER.fields})
"""Manifest keys the cache sets itself; free metadata must not use them."""

_PAYLOAD_SUFFIX = ".safetensors"
_MARKER_SUFFIX = ".meta.json"
_ROLLOUT_MARKER = "meta.json"
STEP_DIR_NAME = re.compile(r"0|-?[1-9][0-9]*")
STAGE_NAME = re.compile(r"[A-Za-z0-9_-]+")


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


SHAPE_KEYS = (
    "data.gen_batch_size",
    "actor_rollout_ref.rollout.n",
    "data.max_prompt_length",
    "data.max_response_length",
)
"""The config keys the shape part of :func:`config_dir`'s name is made of, in its order (``GBS`` is
``data.gen_batch_size``, which defaults to ``data.train_batch_size``)."""
_SHAPE = re.compile(r"GBS(\d+)_N(\d+)_in(\d+)_out(\d+)")


def shape_values(shape: str) -> dict[str, int] | None:
    """:data:`SHAPE_KEYS` and their values in the shape part of a :func:`config_dir` name; None for another name."""
    match = _SHAPE.fullmatch(shape)
    return None if match is None else dict(zip(SHAPE_KEYS, map(int, match.groups())))


def payload_name(stage: str) -> str:
    """File name of a stage's payload inside a step directory."""
    return f"{stage}{_PAYLOAD_SUFFIX}"


def marker_name(stage: str) -> str:
    """File name of a stage's commit marker inside a step directory."""
    return _ROLLOUT_MARKER if stage == ROLLOUT_STAGE else f"{stage}{_MARKER_SUFFIX}"


def stage_of(file_name: str) -> str | None:
    """The stage whose payload or marker is named ``file_name``, if any."""
    if file_name == _ROLLOUT_MARKER:
        return ROLLOUT_STAGE
    for suffix in (_PAYLOAD_SUFFIX, _MARKER_SUFFIX):
        if file_name.endswith(suffix):
            stage = file_name[: -len(suffix)]
            if STAGE_NAME.fullmatch(stage) and file_name in (payload_name(stage), marker_name(stage)):
                return stage
    return None


def parse_marker_key(key: str) -> tuple[str, int, str]:
    """``(config directory, step, stage)`` of a marker path ``{config directory}/{step}/{marker}``.

    Raises ``ValueError`` unless the step directory is a canonical integer and the file name is a
    marker name (see :func:`marker_name`)."""
    config_path, _, rest = key.strip("/").rpartition("/")
    config_path, _, step_dir = config_path.rpartition("/")
    stage = stage_of(rest)
    if not STEP_DIR_NAME.fullmatch(step_dir) or stage is None or marker_name(stage) != rest:
        raise ValueError(f"{key!r} is not a step-cache marker path ({{config}}/{{step}}/{{marker}})")
    return config_path, int(step_dir), stage


def as_step(step: int) -> int:
    """``step`` as a plain int; bools and non-integers raise ``TypeError``."""
    if isinstance(step, bool):
        raise TypeError("a step must be an int, not a bool")
    return operator.index(step)


def decode_manifest(data: bytes | memoryview) -> dict:
    """Parse and check a manifest; ``ValueError`` says what is wrong."""
    manifest = STEP_MARKER.decode(data)
    if len(manifest["files"]) != 1:
        raise ValueError(f"manifest must list exactly one payload, got {sorted(manifest['files'])}")
    if manifest["num_trajectories"] < 0:
        raise ValueError(f"manifest records {manifest['num_trajectories']} trajectories")
    return manifest


def manifest_mismatch(manifest: dict, step: int, stage: str) -> str:
    """Why a decoded manifest does not belong at ``step``/``stage`` ("" when it does)."""
    if manifest["global_steps"] != step:
        return f"marker records global_steps {manifest['global_steps']}, not {step}"
    if manifest["stage"] != stage:
        return f"marker records stage {manifest['stage']!r}, not {stage!r}"
    if list(manifest["files"]) != [payload_name(stage)]:
        return f"marker lists {sorted(manifest['files'])}, not {payload_name(stage)!r}"
    return ""


def recorded_differences(required: dict, manifest: dict, prefix: str = "") -> list[str]:
    """``name: recorded -> required`` for each required value the manifest recorded otherwise (nested
    mappings are compared key by key): why an entry was made from another input or in another way."""
    differences = []
    for name, value in required.items():
        recorded = manifest.get(name)
        if isinstance(value, dict) and isinstance(recorded, dict):
            differences += recorded_differences(value, recorded, f"{prefix}{name}.")
        elif recorded != value:
            differences.append(f"{prefix}{name}: {recorded!r} recorded, {value!r} here")
    return differences


def payload_entry(manifest: dict) -> dict:
    """The marker entry (size and sha256) of the manifest's one payload."""
    (entry,) = manifest["files"].values()
    return entry


@dataclass(frozen=True)
class StepStatus:
    """Cheap validity of one stage entry. ``nbytes`` is the payload's size on storage (0 if absent)."""

    step: int
    valid: bool
    reason: str
    nbytes: int


def judge(step: int, stage: str, marker: bytes | Exception | None, payload_size: int | None) -> StepStatus:
    """Cheap validity from the marker's bytes (or its read error, or None if absent) and the payload's size.

    Read errors other than ``OSError`` (e.g. a lost connection) are raised: they say nothing about the entry.
    """
    marker_file = marker_name(stage)
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
        manifest = decode_manifest(marker)
    except ValueError as error:
        return invalid(f"unreadable {marker_file}: {error}")
    problem = manifest_mismatch(manifest, step, stage) or size_problem(
        {payload_name(stage): payload_size}, manifest["files"]
    )
    return invalid(problem) if problem else StepStatus(step, True, "", nbytes)
