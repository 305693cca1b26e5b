"""What each trainer mode needs of the config, by mode name: the registry the config rules, the schema's
descriptions and the flow's choices of ``trainer.mode`` read.

The config layer sits below the flows that implement the modes, so it keeps only this declarative part;
``ppoflow.flows.modes.register_trainer`` adds a mode's :class:`ModeNeeds` here (a user's mode from
``trainer.v1.trainer_module`` when the flow imports that file). The built-in modes are declared here, so a
config is checked the same in a process that never imports the flows (``ppoflow config``, a Ray worker).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Problems = list[tuple[str, str]]
"""``(key, message)`` pairs, as every config rule returns them. The rules take a
:class:`~ppoflow.configs.schema.PPOConfig`, which is built from this module's declarations (no import back)."""


@dataclass(frozen=True)
class ModeNeeds:
    """What a trainer mode needs of the config; checked by :func:`mode_errors`."""

    summary: str = "a registered mode"
    """What the mode does, in a few words (the schema's description and the flow's docstring list it)."""
    rollout_service: bool = False
    """It generates through the rollout service: ``actor_rollout_ref.rollout.mode=async``."""
    generate_stage: bool = True
    """It generates each step's batch in the generate stage (``skip.rollout`` caches it); a streaming mode
    samples a replay buffer instead (its samples are cached per prompt by ``skip.async_rollout``)."""
    on_policy: bool = False
    """It generates only while the actor waits, so every sample comes from the actor's current weights: the
    actor's worker may serve generation (``actor_rollout_ref.hybrid_engine``)."""
    same_device_pools: bool = False
    """Its two pools (training, rollout) are both on GPUs or both on CPUs."""
    rules: tuple[Callable[..., Problems], ...] = ()
    """Further rules of its own, each returning ``(key, message)`` pairs."""


MODE_NEEDS: dict[str, ModeNeeds] = {}
"""Every mode the config knows, in registration order (the built-in ones first)."""

DEFAULT_MODE = "sync"
"""The mode of a config that sets neither ``trainer.mode`` nor ``trainer.v1.trainer_mode``."""


def declare_mode(name: str, needs: ModeNeeds) -> ModeNeeds:
    """Make ``name`` a mode the config knows (again: a mode's file imported by a second run replaces it)."""
    MODE_NEEDS[name] = needs
    return needs


def needs_of(mode: str) -> ModeNeeds:
    """The declared needs of ``mode``; a mode not registered (yet) is taken to need nothing and not to be
    on-policy, the cautious reading (its file is imported, and its rules checked, by the flow)."""
    return MODE_NEEDS.get(mode, ModeNeeds())


def mode_list() -> str:
    """The registered modes with their summaries, e.g. ``sync (generate, then train), ...``."""
    return ", ".join(f"{name} ({needs.summary})" for name, needs in MODE_NEEDS.items())


def on_policy_modes() -> str:
    """The registered on-policy modes' names, e.g. ``trainer.mode=sync``."""
    return " or ".join(f"trainer.mode={name}" for name, needs in MODE_NEEDS.items() if needs.on_policy)


def mode_errors(cfg) -> Problems:
    """What ``cfg``'s trainer mode needs and the config does not give; none for a mode not registered."""
    mode = cfg.trainer.mode
    if mode not in MODE_NEEDS:
        return []
    needs, errors = MODE_NEEDS[mode], []
    if needs.rollout_service and cfg.actor_rollout_ref.rollout.mode != "async":
        how = "generates with" if needs.generate_stage else "streams prompts through"
        errors.append(("trainer.mode", f"{mode} {how} the rollout service; set actor_rollout_ref.rollout.mode=async"))
    for rule in needs.rules:
        errors += rule(cfg)
    step_cache = cfg.skip.get("rollout")
    if not needs.generate_stage and step_cache is not None and step_cache.enable:
        errors.append(
            (
                "skip.rollout.enable",
                f"{mode} has no generate stage per step to cache; its samples are "
                "cached one prompt at a time with skip.async_rollout",
            )
        )
    trainer_gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rollout_gpus = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    if needs.same_device_pools and (trainer_gpus > 0) != (rollout_gpus > 0):
        errors.append(
            (
                "rollout.n_gpus_per_node",
                f"{mode} needs both pools on GPUs or both on CPUs "
                f"(training pool {trainer_gpus} GPUs, rollout pool {rollout_gpus})",
            )
        )
    return errors


def _updates_fill_the_batch(cfg) -> Problems:
    """separate_async trains ``parameter_sync_step`` mini-batches per step: they must make up the batch
    (a config error here, an assert in verl)."""
    sync_step = cfg.trainer.v1.separate_async.parameter_sync_step
    mini_batch = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    if cfg.data.train_batch_size == sync_step * mini_batch:
        return []
    return [
        (
            "trainer.v1.separate_async.parameter_sync_step",
            f"separate_async trains parameter_sync_step ({sync_step}) mini-batches of "
            f"ppo_mini_batch_size ({mini_batch}) prompts per step, so data.train_batch_size "
            f"({cfg.data.train_batch_size}) must be {sync_step * mini_batch}: set "
            f"parameter_sync_step={cfg.data.train_batch_size // mini_batch} or "
            f"ppo_mini_batch_size={cfg.data.train_batch_size // sync_step}",
        )
    ]


declare_mode(DEFAULT_MODE, ModeNeeds(summary="generate, then train", on_policy=True))
declare_mode(
    "one_step_off", ModeNeeds(summary="generate the next batch while training on this one", same_device_pools=True)
)
declare_mode(
    "colocate_async",
    ModeNeeds(
        summary="verl's V1: a replay buffer between a continuous rollout and the trainer, taking turns",
        rollout_service=True,
        generate_stage=False,
    ),
)
declare_mode(
    "separate_async",
    ModeNeeds(
        summary="verl's V1 on separate resources, parameter_sync_step updates per weight push",
        rollout_service=True,
        generate_stage=False,
        rules=(_updates_fill_the_batch,),
    ),
)
