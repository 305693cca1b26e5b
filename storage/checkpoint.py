"""Atomic, resumable checkpoints under ``trainer.default_local_dir`` (any fsspec URL).

Layout (verl's ``global_step_{N}`` directories)::

    {run_dir}/global_step_{N}/actor/model.safetensors      weights (safetensors: nothing is unpickled)
                              actor/optimizer.pt          optimizer + LR schedule (torch.load(weights_only=True))
                              critic/...                  the same, when a critic runs
                              rollout_in_flight.safetensors  one_step_off: the batch generated for step N+1
                              trainer_state.json          step, dataloader position, KL controller, ...
                              checkpoint.json             commit marker, written LAST: every file's size and sha256
    {run_dir}/latest_checkpointed_iteration.txt           verl's pointer, informational

A directory is *complete* only when ``checkpoint.json`` exists and every file it lists has the
listed size; loading also checks the sha256. An incomplete directory (a crash mid-save) is never
chosen for resuming.
"""

from __future__ import annotations

import hashlib
import io
import json
import re

import torch
from safetensors.torch import save as safetensors_save

from ppoflow.storage.batch import read_safetensors
from ppoflow.storage.fs import atomic_write, join, open_fs, read_with_sha256, write_with_retries

MARKER = "checkpoint.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"global_step_(\d+)")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file."""


def step_url(run_dir: str, step: int) -> str:
    return join(run_dir, f"global_step_{step}")


def write_file(url: str, data: bytes, *, retries: int = 3, backoff_s: float = 0.5) -> dict:
    """Write one checkpoint file atomically (with retries); return its manifest entry."""
    fs, path = open_fs(url)
    write_with_retries(url, lambda: atomic_write(fs, path, data), retries=retries, backoff_s=backoff_s)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_file(url: str, entry: dict) -> memoryview:
    """Read one checkpoint file and check it against its manifest entry."""
    fs, path = open_fs(url)
    data, digest = read_with_sha256(fs, path)
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        raise CheckpointError(f"{url}: size or checksum does not match {MARKER}")
    return data


def save_module(directory: str, model: torch.nn.Module, optimizer_state: dict) -> dict[str, dict]:
    """Write a role's weights and optimizer state into ``directory``; return manifest entries by file name."""
    weights = safetensors_save({name: tensor.detach().cpu().contiguous() for name, tensor in _unique(model).items()})
    buffer = io.BytesIO()
    torch.save(optimizer_state, buffer)
    return {"model.safetensors": write_file(join(directory, "model.safetensors"), weights),
            "optimizer.pt": write_file(join(directory, "optimizer.pt"), buffer.getvalue())}


def load_module(directory: str, entries: dict[str, dict], model: torch.nn.Module) -> dict:
    """Restore a role's weights (in place) from ``directory``; return its optimizer state."""
    weights, _ = read_safetensors(read_file(join(directory, "model.safetensors"), entries["model.safetensors"]))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(name not in weights for name in _unique(model)):
        raise CheckpointError(f"{directory}: weights do not fit the model (missing {missing}, unexpected {unexpected})")
    data = read_file(join(directory, "optimizer.pt"), entries["optimizer.pt"])
    return torch.load(io.BytesIO(data), weights_only=True)


def commit(run_dir: str, step: int, files: dict[str, dict], trainer_state: dict) -> str:
    """Write ``trainer_state.json`` and then the marker: the checkpoint of ``step`` is complete."""
    directory = step_url(run_dir, step)
    files = {**files, "trainer_state.json": write_file(join(directory, "trainer_state.json"),
                                                       json.dumps(trainer_state, sort_keys=True).encode())}
    marker = {"format_version": FORMAT_VERSION, "global_step": step, "files": files}
    write_file(join(directory, MARKER), json.dumps(marker, sort_keys=True, indent=1).encode())
    write_file(join(run_dir, "latest_checkpointed_iteration.txt"), str(step).encode())
    return directory


def manifest(directory: str) -> dict | None:
    """The marker of a complete checkpoint directory; None when it is absent or incomplete."""
    fs, path = open_fs(directory)
    try:
        marker = json.loads(fs.cat_file(f"{path}/{MARKER}"))
        for name, entry in marker["files"].items():
            if fs.size(f"{path}/{name}") != entry["bytes"]:
                return None
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return marker


def latest(run_dir: str) -> str | None:
    """The newest complete ``global_step_N`` directory under ``run_dir`` (None if there is none)."""
    fs, path = open_fs(run_dir)
    try:
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return None
    steps = sorted((int(match.group(1)) for name in names if (match := _STEP_DIR.fullmatch(name))), reverse=True)
    for step in steps:
        directory = step_url(run_dir, step)
        if manifest(directory) is not None:
            return directory
    return None


def read_trainer_state(directory: str) -> tuple[dict, dict]:
    """The marker and the trainer state of a checkpoint directory (which must be complete)."""
    marker = manifest(directory)
    if marker is None:
        raise CheckpointError(f"{directory} is not a complete checkpoint (no valid {MARKER})")
    state = json.loads(bytes(read_file(join(directory, "trainer_state.json"), marker["files"]["trainer_state.json"])))
    return marker, state


def _unique(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without aliases (tied embeddings share storage; safetensors refuses duplicates)."""
    seen: set[int] = set()
    unique = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    return unique

