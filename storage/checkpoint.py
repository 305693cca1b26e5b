"""Atomic, resumable checkpoints under ``trainer.default_local_dir`` (any fsspec URL).

verl's ``global_step_{N}`` directories hold the weights (safetensors), the optimizer state
(``torch.load(weights_only=True)``), the trainer state (JSON) and, written last, ``checkpoint.json``: a commit
marker (:mod:`ppoflow.storage.marker`) listing every file's size and sha256. An incomplete or malformed directory is
never chosen for resuming, and a skipped ``global_step_N`` gets a warning saying why; :func:`complete_checkpoints`
lists what is left, newest first, so a resume falls back when :func:`verify_checkpoint` fails.
The layout: docs/reliability.md#nothing-is-lost-and-resume-finds-the-newest-valid-state.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import torch
from safetensors.torch import save as safetensors_save

from ppoflow.storage.batch import read_safetensors
from ppoflow.storage.fs import StorageError, atomic_write, join, open_fs, write_with_retries
from ppoflow.storage.marker import MarkerFormat, file_entry, read_verified, size_problem

logger = logging.getLogger(__name__)

MARKER = "checkpoint.json"
CHECKPOINT_MARKER = MarkerFormat(version=1, fields={"global_step": int})
_STEP_DIR = re.compile(r"global_step_(0|[1-9]\d*)")  # one spelling per step: step_url's


class CheckpointError(StorageError):
    """A checkpoint file that cannot be used; ``path`` names it."""


def step_url(run_dir: str, step: int) -> str:
    return join(run_dir, f"global_step_{step}")


EXPORTED_MODEL = "actor/huggingface"
"""Where in ``global_step_N`` the run's final policy is exported (``save_pretrained``; verl's place for it)."""


def exported_model_url(run_dir: str, step: int) -> str:
    return join(step_url(run_dir, step), EXPORTED_MODEL)


def _holds_only_the_exported_model(fs, path: str) -> bool:
    """Whether a ``global_step_N`` directory without a marker is just the final model's export (no save was
    begun there: a run without a checkpoint at its last step), not a checkpoint whose save did not finish."""
    parent, leaf = EXPORTED_MODEL.split("/")
    try:
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)] == [parent] and [
            entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(f"{path}/{parent}", detail=False)
        ] == [leaf]
    except OSError:
        return False


def write_file(url: str, data: bytes | memoryview, *, retries: int = 3, backoff_s: float = 0.5) -> dict:
    """Write one checkpoint file atomically (with retries); return its manifest entry."""
    fs, path = open_fs(url)
    write_with_retries(url, lambda: atomic_write(fs, path, data), retries=retries, backoff_s=backoff_s)
    return file_entry(data)


def read_file(url: str, entry: dict) -> memoryview:
    """Read one checkpoint file and check it against its manifest entry (:class:`CheckpointError` if not)."""
    fs, path = open_fs(url)
    return read_verified(fs, path, entry, error=CheckpointError)


def save_module(directory: str, weights: dict[str, torch.Tensor], optimizer_state: dict) -> dict[str, dict]:
    """Write a role's full weights (no tied aliases: safetensors refuses duplicates) and optimizer state
    into ``directory``; return manifest entries by file name."""
    data = safetensors_save({name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()})
    buffer = io.BytesIO()
    torch.save(optimizer_state, buffer)
    return {
        "model.safetensors": write_file(join(directory, "model.safetensors"), data),
        "optimizer.pt": write_file(join(directory, "optimizer.pt"), buffer.getbuffer()),  # a view: no second copy
    }


def load_module(
    directory: str, entries: dict[str, dict], shapes: dict[str, torch.Size]
) -> tuple[dict[str, torch.Tensor], dict]:
    """A role's weights and optimizer state from ``directory``, checked against the model's ``shapes``
    (name -> full shape, no tied aliases).

    Weights that do not fit (names or shapes) raise :class:`CheckpointError`, as does a file that cannot
    be decoded; nothing is returned half-checked, so the caller loads all or nothing.
    """
    weights = read_decoded(directory, entries, "model.safetensors", lambda data: read_safetensors(data)[0])
    missing = [name for name in shapes if name not in weights]
    unexpected = [name for name in weights if name not in shapes]
    misshapen = [name for name, tensor in weights.items() if name in shapes and tensor.shape != shapes[name]]
    if missing or unexpected or misshapen:
        raise CheckpointError(
            directory,
            f"weights do not fit the model (missing {missing}, unexpected {unexpected}, other shape {misshapen})",
        )
    optimizer_state = read_decoded(
        directory, entries, "optimizer.pt", lambda data: torch.load(io.BytesIO(data), weights_only=True)
    )
    return weights, optimizer_state


def read_decoded(directory: str, files: dict[str, dict], name: str, decode):
    """``decode`` applied to the verified file ``name`` of a checkpoint directory (``files``: its marker
    entries); :class:`CheckpointError` when the file is not listed, does not verify or cannot be decoded."""
    url = join(directory, name)
    if name not in files:
        raise CheckpointError(url, f"not listed in {MARKER}")
    data = read_file(url, files[name])
    try:
        return decode(data)
    except Exception as error:  # json, safetensors, torch.load and tensordict each raise their own types
        raise CheckpointError(url, f"cannot be decoded: {error}") from error


def commit(run_dir: str, step: int, files: dict[str, dict], trainer_state: dict) -> str:
    """Write ``trainer_state.json`` and then the marker: the checkpoint of ``step`` is complete."""
    directory = step_url(run_dir, step)
    files = {
        **files,
        "trainer_state.json": write_file(
            join(directory, "trainer_state.json"), json.dumps(trainer_state, sort_keys=True).encode()
        ),
    }
    write_file(join(directory, MARKER), CHECKPOINT_MARKER.encode(files, global_step=step))
    write_file(join(run_dir, "latest_checkpointed_iteration.txt"), str(step).encode())
    return directory


def manifest(directory: str) -> dict | None:
    """The marker of a complete checkpoint directory; None when it is absent, malformed or incomplete."""
    return checked_manifest(directory)[0]


def checked_manifest(directory: str) -> tuple[dict | None, str]:
    """The marker of a complete checkpoint directory and ""; or None and why the directory is not one
    (no marker, an unreadable or damaged one, a listed file missing or of another size)."""
    fs, path = open_fs(directory)
    try:
        data = fs.cat_file(f"{path}/{MARKER}")
    except FileNotFoundError:
        return None, f"no {MARKER} (its save did not finish)"
    except OSError as error:
        return None, f"unreadable {MARKER}: {error!r}"
    try:
        marker = CHECKPOINT_MARKER.decode(data)
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deeply to parse
        return None, f"damaged {MARKER}: {type(error).__name__}: {error}"[:500]
    try:
        sizes = {name: _size(fs, f"{path}/{name}") for name in marker["files"]}
    except OSError as error:
        return None, f"a listed file cannot be listed: {error!r}"
    problem = size_problem(sizes, marker["files"])
    return (None, problem) if problem else (marker, "")


def complete_checkpoints(run_dir: str) -> list[str]:
    """The complete ``global_step_N`` directories under ``run_dir``, newest first.

    Only directories count (a file named ``global_step_5`` is skipped), and only those whose marker
    is valid, lists every file with its size and records the directory's own step; every other
    ``global_step_N`` directory is skipped with a warning naming it and why.
    """
    return list(_complete_newest_first(run_dir))


def latest(run_dir: str) -> str | None:
    """The newest complete ``global_step_N`` directory under ``run_dir`` (None if there is none)."""
    return next(_complete_newest_first(run_dir), None)


def verify_checkpoint(directory: str) -> dict:
    """The marker of ``directory`` once every file it lists has been read and found to have its recorded
    size and sha256; :class:`CheckpointError` naming the first file that does not (or the directory,
    when it is not complete). Loading can then not fail half-way through on a damaged file."""
    marker = _complete_marker(directory)
    for name, entry in marker["files"].items():
        read_file(join(directory, name), entry)
    return marker


def read_trainer_state(directory: str) -> tuple[dict, dict]:
    """The marker and the trainer state of a checkpoint directory (which must be complete)."""
    marker = _complete_marker(directory)
    state = read_decoded(directory, marker["files"], "trainer_state.json", lambda data: json.loads(bytes(data)))
    if not (isinstance(state, dict) and type(state.get("global_step")) is int):
        raise CheckpointError(
            join(directory, "trainer_state.json"), "not a trainer state (a JSON object with an integer global_step)"
        )
    return marker, state


def _complete_newest_first(run_dir: str) -> Iterator[str]:
    """:func:`complete_checkpoints`, lazily: a caller that wants the newest reads no older marker."""
    fs, path = open_fs(run_dir)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return
    steps = sorted(
        (
            int(match.group(1))
            for entry in entries
            if entry["type"] == "directory"
            and (match := _STEP_DIR.fullmatch(entry["name"].rstrip("/").rsplit("/", 1)[-1]))
        ),
        reverse=True,
    )
    for step in steps:
        directory = step_url(run_dir, step)
        marker, problem = checked_manifest(directory)
        if marker is not None and marker["global_step"] != step:
            problem = f"its {MARKER} records global_step {marker['global_step']}"
        if marker is None and _holds_only_the_exported_model(fs, f"{path}/global_step_{step}"):
            continue
        if problem:
            logger.warning("skipping checkpoint %s: %s", directory, problem)
        else:
            yield directory


def _complete_marker(directory: str) -> dict:
    marker, problem = checked_manifest(directory)
    if marker is None:
        raise CheckpointError(directory, f"not a complete checkpoint ({problem})")
    return marker


def _size(fs, path: str) -> int | None:
    try:
        return fs.size(path)
    except FileNotFoundError:
        return None
