"""Checkpointing a run and resuming it (the storage side is :mod:`storage.checkpoint`).

A checkpoint holds everything the next steps depend on: the actor's (and critic's) weights and
optimizer state, the dataloader position, the KL controller, the weight version, and - in
one_step_off mode - the batch already generated for the next step. Sampling seeds depend only on
``(seed, step)``, so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.stages import PendingStage, StageResult
from ppoflow.storage.batch import decode_batch, encode_batch
from ppoflow.storage.checkpoint import commit, latest, read_file, read_trainer_state, step_url, write_file
from ppoflow.storage.fs import join

if TYPE_CHECKING:
    from ppoflow.flows.train import Run

IN_FLIGHT = "rollout_in_flight.safetensors"
"""A one_step_off checkpoint's batch generated for the next step."""


def save_checkpoint(run: Run, step: int, pending: PendingStage | None) -> tuple[str, PendingStage | None]:
    """Checkpoint everything a resumed run needs to reproduce the next steps exactly.

    The actor (and critic) write their own weights and optimizer state; one_step_off's batch in
    flight (generated for step+1) is awaited and saved too, so nothing generated is lost.
    """
    directory = step_url(run.cfg.trainer.default_local_dir, step)
    files = {f"actor/{name}": entry for name, entry in
             run.workers.get(run.workers.actor.submit("save_checkpoint", join(directory, "actor"))).items()}
    if run.cfg.use_critic:
        files.update({f"critic/{name}": entry for name, entry in
                      run.workers.get(run.workers.critic.submit("save_checkpoint", join(directory, "critic"))).items()})
    if pending is not None:
        generated = pending.result()
        files[IN_FLIGHT] = write_file(join(directory, IN_FLIGHT), encode_batch(generated.fields))
        pending = PendingStage(lambda: generated)
    state = {"global_step": step, "dataloader": run.loader.state_dict(), "kl_controller": run.kl_controller.state_dict(),
             "weight_version": step,  # the actor updates once per step
             "epochs": {str(k): v for k, v in run.epochs.items() if k > step}}
    return commit(run.cfg.trainer.default_local_dir, step, files, state), pending


def restore(run: Run, directory: str) -> tuple[int, PendingStage | None]:
    """Load a checkpoint into the run's workers and loader; return the first step to train and the
    batch that was in flight. The caller then pushes the restored weights to the rollout worker."""
    marker, state = read_trainer_state(directory)
    files = marker["files"]

    def entries(role: str) -> dict:
        return {name.split("/", 1)[1]: entry for name, entry in files.items() if name.startswith(f"{role}/")}

    run.workers.get(run.workers.actor.submit("load_checkpoint", join(directory, "actor"), entries("actor"),
                                             state["weight_version"]))
    if run.cfg.use_critic:
        run.workers.get(run.workers.critic.submit("load_checkpoint", join(directory, "critic"), entries("critic")))
    run.loader.load_state_dict(state["dataloader"])
    run.kl_controller.load_state_dict(state["kl_controller"])
    run.epochs.update({int(step): epoch for step, epoch in state["epochs"].items()})
    in_flight = None
    if IN_FLIGHT in files:
        batch = decode_batch(read_file(join(directory, IN_FLIGHT), files[IN_FLIGHT]))
        in_flight = PendingStage(lambda: StageResult(batch, {}))
        run.launch_versions[state["global_step"] + 1] = int(batch["weight_version"].max())
    return state["global_step"] + 1, in_flight


def resume_point(cfg: PPOConfig) -> str | None:
    """The checkpoint to resume from, per ``trainer.resume_mode``."""
    if cfg.trainer.resume_mode == "disable":
        return None
    if cfg.trainer.resume_mode == "resume_path":
        return cfg.trainer.resume_from_path
    return latest(cfg.trainer.default_local_dir)
