"""Rules of the profiler's keys (``global_profiler``, ``<role>.profiler``): a profile asked for is one that
can be made, before anything starts."""

from __future__ import annotations

from ppoflow.configs.schema import PPOConfig

ARR = "actor_rollout_ref"


def profiler_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``(key, message)`` pairs for profiler settings that would record nothing or cannot record."""
    arr, profiler = cfg.actor_rollout_ref, cfg.global_profiler
    sections = _roles(cfg)
    enabled = [key for key, section in sections.items() if section.profiler.enable]
    errors: list[tuple[str, str]] = []
    if profiler.steps and not enabled:
        errors.append(
            (
                "global_profiler.steps",
                "no role is profiled: set <role>.profiler.enable=true (actor, ref, rollout, critic)",
            )
        )
    if profiler.steps and enabled and profiler.tool is None:
        errors.append(("global_profiler.tool", "global_profiler.steps are profiled with a tool: torch or torch_memory"))
    rollout = arr.rollout
    if f"{ARR}.rollout" in enabled and (rollout.mode == "async" or rollout.name == "vllm"):
        errors.append(
            (
                f"{ARR}.rollout.profiler.enable",
                f"the rollout is profiled only with rollout.name=hf and rollout.mode=sync (got {rollout.name}, "
                f"{rollout.mode}): vLLM and the rollout service run their own processes",
            )
        )
    if cfg.ref_in_actor and f"{ARR}.ref" in enabled and f"{ARR}.actor" not in enabled:
        errors.append(
            (
                f"{ARR}.ref.profiler.enable",
                "the reference runs in the actor's processes (LoRA: the actor's base model); set "
                f"{ARR}.actor.profiler.enable=true",
            )
        )
    if cfg.colocated and f"{ARR}.rollout" in enabled and f"{ARR}.actor" not in enabled:
        errors.append(
            (
                f"{ARR}.rollout.profiler.enable",
                f"the rollout runs in the actor's processes (colocated); set {ARR}.actor.profiler.enable=true",
            )
        )
    if profiler.tool == "torch_memory":
        # a colocated rollout runs on the actor's resources
        placed = {**sections, **({f"{ARR}.rollout": arr.actor} if cfg.colocated else {})}
        on_cpu = [key for key in enabled if placed[key].resources.num_gpus == 0]
        if on_cpu:
            errors.append(
                (
                    "global_profiler.tool",
                    f"torch_memory records CUDA allocations; {', '.join(on_cpu)} run(s) on CPU (resources.num_gpus=0)",
                )
            )
    return errors


def _roles(cfg: PPOConfig) -> dict:
    """The sections of the roles that have a ``profiler``, by key."""
    arr = cfg.actor_rollout_ref
    return {f"{ARR}.actor": arr.actor, f"{ARR}.ref": arr.ref, f"{ARR}.rollout": arr.rollout, "critic": cfg.critic}
