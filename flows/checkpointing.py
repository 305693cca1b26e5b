"""Checkpointing a run and resuming it (the storage side is :mod:`ppoflow.storage.checkpoint`).

A checkpoint holds everything the next steps depend on: the actor's (and critic's) weights and optimizer
state, which the workers write themselves, and the states of the trainer and of its mode
(``state_dict()``), of which this module knows nothing but their shape: JSON, except that a batch in them
(one_step_off's batch generated for the next step) is written as safetensors beside the JSON. Sampling
seeds depend only on ``(seed, step)``, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

from tensordict import TensorDict

from ppoflow.configs.schema import PPOConfig
from ppoflow.storage.batch import decode_batch, encode_batch
from ppoflow.storage.checkpoint import commit, latest, read_file, read_trainer_state, step_url, write_file
from ppoflow.storage.fs import join
from ppoflow.workers.group import Workers

BATCH_FILE = "{name}.safetensors"
"""Where a batch found in a state dict under ``name`` is written inside the checkpoint directory."""


def save_checkpoint(cfg: PPOConfig, workers: Workers, step: int, states: dict[str, dict]) -> str:
    """Write the workers' weights and optimizers, then ``states`` (``{part: state_dict}``), then commit."""
    directory = step_url(cfg.trainer.default_local_dir, step)
    files = {f"actor/{name}": entry for name, entry in
             workers.get(workers.actor.submit("save_checkpoint", join(directory, "actor"))).items()}
    if cfg.use_critic:
        files.update({f"critic/{name}": entry for name, entry in
                      workers.get(workers.critic.submit("save_checkpoint", join(directory, "critic"))).items()})
    saved = {}
    for part, state in states.items():
        saved[part] = _externalize(state, part, directory, files)
    return commit(cfg.trainer.default_local_dir, step, files, {"global_step": step, **saved})


def restore_checkpoint(cfg: PPOConfig, workers: Workers, directory: str) -> tuple[int, dict[str, dict]]:
    """Load a checkpoint into the workers; return its step and the states saved with it (batches decoded)."""
    marker, saved = read_trainer_state(directory)
    files = marker["files"]

    def entries(role: str) -> dict:
        return {name.split("/", 1)[1]: entry for name, entry in files.items() if name.startswith(f"{role}/")}

    step = saved.pop("global_step")
    parts = {part: _internalize(state, directory, files) for part, state in saved.items()}
    workers.get(workers.actor.submit("load_checkpoint", join(directory, "actor"), entries("actor"),
                                     parts["trainer"]["weight_version"]))
    if cfg.use_critic:
        workers.get(workers.critic.submit("load_checkpoint", join(directory, "critic"), entries("critic")))
    return step, parts


def resume_point(cfg: PPOConfig) -> str | None:
    """The checkpoint to resume from, per ``trainer.resume_mode``."""
    if cfg.trainer.resume_mode == "disable":
        return None
    if cfg.trainer.resume_mode == "resume_path":
        return cfg.trainer.resume_from_path
    return latest(cfg.trainer.default_local_dir)


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
            return decode_batch(read_file(join(directory, value["batch_file"]), files[value["batch_file"]]))
        return {key: _internalize(item, directory, files) for key, item in value.items()}
    return value
