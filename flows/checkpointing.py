"""Checkpointing a run and resuming it (the storage side is :mod:`ppoflow.storage.checkpoint`).

A checkpoint holds the actor's (and critic's) weights and optimizer state, written by the workers, and the
``state_dict()`` of the trainer and its mode, known here only by its shape: JSON, with any batch in it (one_step_off's
batch generated for the next step) as safetensors beside the JSON. Sampling seeds depend only on ``(seed, step)``, so
a resumed run reproduces an uninterrupted one. :func:`restore_newest` verifies every file before loading any and
skips a damaged checkpoint, with a warning, for the next older one. Details: docs/reliability.md.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from tensordict import TensorDict

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig
from ppoflow.storage.batch import decode_batch, encode_batch
from ppoflow.storage.checkpoint import (
    CheckpointError,
    commit,
    complete_checkpoints,
    read_decoded,
    read_trainer_state,
    step_url,
    verify_checkpoint,
    write_file,
)
from ppoflow.storage.fs import join, open_fs, remove_stale_temp_files
from ppoflow.workers.roles import Workers

logger = logging.getLogger(__name__)

BATCH_FILE = "{name}.safetensors"
"""Where a batch found in a state dict under ``name`` is written inside the checkpoint directory."""


class Restored(NamedTuple):
    """A checkpoint loaded into the workers: its directory, its step and the states saved with it."""

    directory: str
    step: int
    parts: dict[str, dict]


def save_checkpoint(cfg: PPOConfig, workers: Workers, step: int, states: dict[str, dict]) -> str:
    """Write the workers' weights and optimizers, then ``states`` (``{part: state_dict}``), then commit."""
    directory = step_url(cfg.trainer.default_local_dir, step)
    files = {f"actor/{name}": entry for name, entry in workers.actor.save_checkpoint(join(directory, "actor")).items()}
    if cfg.use_critic:
        files.update(
            {
                f"critic/{name}": entry
                for name, entry in workers.critic.save_checkpoint(join(directory, "critic")).items()
            }
        )
    saved = {}
    for part, state in states.items():
        saved[part] = _externalize(state, part, directory, files)
    return commit(cfg.trainer.default_local_dir, step, files, {"global_step": step, **saved})


def restore_checkpoint(cfg: PPOConfig, workers: Workers, directory: str) -> tuple[int, dict[str, dict]]:
    """Load a checkpoint into the workers; return its step and the states saved with it (batches decoded).

    Every file is verified (size and sha256) first, so a damaged checkpoint raises :class:`CheckpointError`
    before the workers have loaded any of it.
    """
    verify_checkpoint(directory)
    marker, saved = read_trainer_state(directory)
    files = marker["files"]

    def entries(role: str) -> dict:
        return {name.split("/", 1)[1]: entry for name, entry in files.items() if name.startswith(f"{role}/")}

    step = saved.pop("global_step")
    parts = {part: _internalize(state, directory, files) for part, state in saved.items()}
    trainer, mode = parts.get("trainer"), parts.get("mode")
    if not (isinstance(trainer, dict) and type(trainer.get("weight_version")) is int and isinstance(mode, dict)):
        raise CheckpointError(join(directory, "trainer_state.json"), "does not hold a trainer state and a mode state")
    workers.actor.load_checkpoint(join(directory, "actor"), entries("actor"), weight_version=trainer["weight_version"])
    if cfg.use_critic:
        workers.critic.load_checkpoint(join(directory, "critic"), entries("critic"))
    return step, parts


def restore_newest(cfg: PPOConfig, workers: Workers) -> Restored | None:
    """Load the checkpoint ``trainer.resume_mode`` asks for into the workers; None when the run starts fresh.

    ``auto`` tries the complete checkpoints of the run directory newest first (:func:`complete_checkpoints`
    skips an incomplete one, with a warning naming it and why) and skips, with a warning too, one that fails
    to load (a file changed after it was committed, weights that do not fit the model); if checkpoints exist
    but none loads, that is a :class:`ConfigError` rather than a fresh start over them. ``resume_path`` loads
    exactly ``trainer.resume_from_path`` (a :class:`ConfigError` naming that key if it cannot be loaded);
    ``disable`` never resumes. Temp files that killed writes left in the run directory are removed first.
    """
    run_dir = cfg.trainer.default_local_dir
    remove_stale_temp_files(*open_fs(run_dir))
    if cfg.trainer.resume_mode == "disable":
        return None
    if cfg.trainer.resume_mode == "resume_path":
        directory = cfg.trainer.resume_from_path
        try:
            return Restored(directory, *restore_checkpoint(cfg, workers, directory))
        except CheckpointError as error:
            raise ConfigError(
                [("trainer.resume_from_path", f"cannot resume from {directory!r}: {_reason(error)}")]
            ) from None
    failures = []
    for directory in complete_checkpoints(run_dir):
        try:
            return Restored(directory, *restore_checkpoint(cfg, workers, directory))
        except CheckpointError as error:
            failures.append(f"{directory}: {_reason(error)}")
            logger.warning("not resuming from checkpoint %s: %s; trying the next older one", directory, _reason(error))
    if failures:
        raise ConfigError(
            [
                (
                    "trainer.default_local_dir",
                    f"no checkpoint in {run_dir!r} can be loaded "
                    f"({'; '.join(failures)}); move them aside, or set trainer.resume_mode=disable "
                    "to start over",
                )
            ]
        )
    return None


def _reason(error: CheckpointError) -> str:
    """What is wrong, without the remote traceback a worker's error carries when it comes through Ray
    (Ray's wrapper is still a :class:`CheckpointError` and passes ``path`` and ``reason`` on)."""
    return f"{error.path}: {error.reason}"


def _externalize(value, name: str, directory: str, files: dict):
    """``value`` as JSON, with every batch in it written to its own file and replaced by a reference."""
    if isinstance(value, TensorDict):
        file_name = BATCH_FILE.format(name=name.replace("/", "."))
        files[file_name] = write_file(join(directory, file_name), encode_batch(value))
        return {"batch_file": file_name}
    if isinstance(value, dict):
        return {key: _externalize(item, f"{name}/{key}", directory, files) for key, item in value.items()}
    return value


def _internalize(value, directory: str, files: dict):
    """The inverse of :func:`_externalize`: references replaced by the verified, decoded batches."""
    if isinstance(value, dict):
        if set(value) == {"batch_file"}:
            return read_decoded(directory, files, value["batch_file"], decode_batch)
        return {key: _internalize(item, directory, files) for key, item in value.items()}
    return value
