"""Memory, foreseen: :func:`estimate_memory` counts, from the models' ``config.json`` alone, the bytes every role's
copy of the weights, gradients and AdamW state needs (a judge model's replicas too), which :func:`memory_problems`
holds against the RAM and GPUs of a local run before anything loads. What the roles hold, measured each step, is
:mod:`ppoflow.workers.memory`. Details: docs/architecture.md#memory.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, replace

import torch

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import FSDPConfig, ModelConfig, PPOConfig, ResourcesConfig
from ppoflow.workers.memory import GIB, proc_kib
from ppoflow.workers.models import builds_model, model_config

HEADROOM = 0.9
"""The share of a device's memory (a GPU, this machine's available RAM) the estimate may take: it counts
weights, gradients and optimizer state only, so a run it refuses cannot fit, and one it passes may still not."""


@dataclass(frozen=True)
class RoleMemory:
    """What one role's processes (ranks or replicas) hold, foreseen: bytes per process by part."""

    role: str
    key: str
    """The role's config section."""
    parts: dict[str, int]
    processes: int
    on_gpu: bool
    gpu_share: float = 1.0
    """The share of its GPU's memory a process may use: its ``num_gpus`` (one device at most), or vLLM's
    ``gpu_memory_utilization``."""
    remedies: tuple[str, ...] = field(default=())
    """The keys that shrink it."""

    @property
    def per_process(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.per_process * self.processes

    def describe(self) -> str:
        unit = "replica" if self.role in ("rollout", "judge") and self.processes > 1 else "rank"
        parts = ", ".join(f"{name} {_gib(size)}" for name, size in self.parts.items())
        times = f" x {self.processes} {unit}s" if self.processes > 1 else ""
        name = "reference" if self.role == "ref" else self.role
        return f"the {name} needs {_gib(self.per_process)}{f' per {unit}' if times else ''} ({parts}){times}"


def _gib(size: float) -> str:
    """A byte count for a message: in GiB, or MiB below one GiB."""
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 1024**2:.1f} MiB"


def parameter_count(model: ModelConfig, *, value_head: bool = False) -> int | None:
    """The parameters of ``model`` (with ``value_head``: as the critic loads it, a scalar head per token instead
    of the LM head), built from its ``config.json`` on the meta device, so no weight is read; None when there is
    nothing to count yet (a model still to be built, a config transformers cannot build)."""
    if builds_model(model):
        return None
    try:
        config = model_config(model, "model.path")
    except ConfigError:  # the model checks report it
        return None
    return _count(json.dumps(config, sort_keys=True), value_head)


@functools.lru_cache(maxsize=16)
def _count(config_json: str, value_head: bool) -> int | None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    values = json.loads(config_json)
    if value_head:
        values = {name: value for name, value in values.items() if name not in ("id2label", "label2id")}
        values["num_labels"] = 1
    try:
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            built = (AutoModelForTokenClassification if value_head else AutoModelForCausalLM).from_config(config)
    except Exception:  # noqa: BLE001 - a remote-code or unusual architecture: no estimate, the load will tell
        return None
    return sum(parameter.numel() for parameter in built.parameters())


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


def _trained(
    role: str, key: str, model: ModelConfig, params: int, engine, ranks: int, *, trains: bool, remedies: tuple = ()
) -> RoleMemory:
    """A training role (actor, critic) or the reference, sharded over ``ranks``: weights, and when it ``trains``
    (in full: not LoRA, whose adapter is not counted) gradients and AdamW's two moments, all in ``model.dtype``;
    FSDP2's gathered copy (in ``mixed_precision.param_dtype``) when several ranks keep it from forward to backward.
    ``remedies``: keys that shrink it, beyond the dtype and, on GPUs, offloading and more ranks."""
    fsdp: FSDPConfig = engine.fsdp_config
    resources: ResourcesConfig = engine.resources
    size, shard = _itemsize(model.dtype), -(-params // ranks)
    parts = {"weights": shard * size}
    if trains:
        parts.update({"gradients": shard * size, "AdamW state": 2 * shard * size})
    compute = fsdp.mixed_precision.param_dtype or model.dtype
    offloaded = fsdp.offload_policy and resources.num_gpus > 0
    if not fsdp.reshard_after_forward and ranks > 1 and not offloaded:  # one rank: unsharded, autocast per op
        parts["gathered weights"] = params * _itemsize(compute)
    on_gpu = resources.num_gpus > 0 and not offloaded
    model_key = "critic.model" if role == "critic" else "actor_rollout_ref.model"
    gpu_keys = (f"{key}.fsdp_config.offload_policy", "trainer.n_gpus_per_node") if on_gpu else ()
    keys = (f"{model_key}.dtype", *gpu_keys, *remedies)
    return RoleMemory(role, key, parts, ranks, on_gpu, min(resources.num_gpus, 1.0) or 1.0, keys)


def _with_sampling_copy(actor: RoleMemory, copy: int) -> RoleMemory:
    """A sharded actor whose ranks generate (colocated): while it samples, each rank also holds the full weights in
    ``rollout.dtype`` (``copy`` bytes), and no gradients; the copy is freed before the update. A rank's peak is the
    larger of the two phases, so the part counts what the copy holds beyond the gradients."""
    beyond = copy - actor.parts.get("gradients", 0)
    if beyond <= 0:
        return actor
    return replace(actor, parts={**actor.parts, "sampling copy": beyond})


def estimate_memory(cfg: PPOConfig) -> tuple[list[RoleMemory], list[str]]:
    """Every role's foreseen memory (:class:`RoleMemory`), and the roles not estimated (their model is still to
    be built, or transformers cannot build its config)."""
    arr, ranks = cfg.actor_rollout_ref, cfg.data_parallel_size
    estimates, missing = [], []
    policy = parameter_count(arr.model)
    if policy is None:
        missing += ["actor"] + (["ref"] if cfg.use_reference else []) + ([] if cfg.colocated else ["rollout"])
    else:
        lora = () if arr.model.lora else ("actor_rollout_ref.model.lora_rank",)
        actor = _trained(
            "actor",
            "actor_rollout_ref.actor",
            arr.model,
            policy,
            arr.actor,
            ranks,
            trains=not arr.model.lora,
            remedies=lora,
        )
        if cfg.colocated and ranks > 1:
            actor = _with_sampling_copy(actor, policy * _itemsize(arr.rollout.dtype))
        estimates.append(actor)
        if cfg.use_reference and not arr.model.lora:  # with LoRA the reference is the base model, adapter off
            kl = ("actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward")
            estimates.append(
                _trained(
                    "ref", "actor_rollout_ref.ref", arr.model, policy, arr.ref, ranks, trains=False, remedies=lora + kl
                )
            )
        estimates += _rollout(cfg, policy)
    if cfg.use_critic:
        critic = parameter_count(cfg.critic.model, value_head=True)
        if critic is None:
            missing.append("critic")
        else:
            enable = ("critic.enable",)
            estimates.append(
                _trained("critic", "critic", cfg.critic.model, critic, cfg.critic, ranks, trains=True, remedies=enable)
            )
    judge = cfg.reward_model.judge
    judge_params = parameter_count(cfg.judge_model) if cfg.judge_model is not None else None
    if judge_params is not None:
        keys = ("reward_model.judge.model.dtype", "reward_model.judge.num_replicas")
        size = judge_params * _itemsize(judge.model.dtype)
        estimates.append(_served("judge", "reward_model.judge", size, judge.resources, judge.num_replicas, keys))
    elif cfg.judge_model is not None:
        missing.append("judge")
    return estimates, missing


def _rollout(cfg: PPOConfig, params: int) -> list[RoleMemory]:
    """The rollout's copies of the policy, in ``rollout.dtype``: none when colocated (it samples with the actor's
    weights, or a cast copy of them that is freed before the update, whose peak the actor's estimate is), one per
    replica of the rollout service, vLLM's share of each of its GPUs (its weights split over the
    tensor-parallel GPUs), else one."""
    key, rollout = "actor_rollout_ref.rollout", cfg.actor_rollout_ref.rollout
    if cfg.colocated:
        return []
    if rollout.name == "vllm":
        tensor_parallel = rollout.tensor_model_parallel_size
        remedies = (
            f"{key}.gpu_memory_utilization",
            f"{key}.tensor_model_parallel_size",
            f"{key}.dtype",
        )
        weights = {"weights": -(-params // tensor_parallel) * _itemsize(rollout.dtype)}
        return [RoleMemory("rollout", key, weights, tensor_parallel, True, rollout.gpu_memory_utilization, remedies)]
    replicas = rollout.num_replicas if rollout.mode == "async" else 1
    remedies = (f"{key}.dtype",) + (("actor_rollout_ref.hybrid_engine",) if replicas == 1 else ())
    return [_served("rollout", key, params * _itemsize(rollout.dtype), rollout.resources, replicas, remedies)]


def _served(role: str, key: str, size: int, resources: ResourcesConfig, replicas: int, remedies: tuple) -> RoleMemory:
    """A model that only generates (the rollout's, a judge's): its weights (``size`` bytes) in each of ``replicas``
    processes on ``resources``."""
    share = min(resources.num_gpus, 1.0) or 1.0
    return RoleMemory(role, key, {"weights": size}, replicas, resources.num_gpus > 0, share, remedies)


@dataclass(frozen=True)
class Budget:
    """The memory a run is given: this machine's available RAM and its smallest GPU's memory (None: unknown,
    a Ray cluster elsewhere, or no GPU in sight)."""

    ram: int | None
    gpu: int | None


def local_budget(cfg: PPOConfig, *, needs_gpu: bool) -> Budget:
    """What a run on a local Ray is given: RAM (MemAvailable, at most the cgroup's limit) and, when a role uses
    GPUs, the smallest GPU's total memory; nothing when the roles run on a Ray cluster (``ray.address``,
    ``RAY_ADDRESS``), whose nodes this process cannot see."""
    if cfg.ray.address or os.environ.get("RAY_ADDRESS") or not os.path.exists("/proc/meminfo"):
        return Budget(None, None)
    ram = proc_kib("/proc/meminfo", "MemAvailable") * 1024
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        if os.path.exists(limit_file):
            with open(limit_file) as limit:
                text = limit.read().strip()
            ram = min(ram, int(text)) if text.isdigit() else ram
    gpu = None
    if needs_gpu and torch.cuda.device_count() > 0:  # device properties need no CUDA context
        gpu = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    return Budget(ram, gpu)


def memory_problems(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``(key, message)`` for each role of a run that cannot fit what it is given (:func:`local_budget`): the
    roles in RAM together beyond :data:`HEADROOM` of the available RAM (one message per role), a GPU role's
    process beyond that share of its GPU. Each names the bytes needed and available, and the keys to change."""
    estimates, _ = estimate_memory(cfg)
    budget = local_budget(cfg, needs_gpu=any(estimate.on_gpu for estimate in estimates))
    problems = []
    in_ram = [estimate for estimate in estimates if not estimate.on_gpu]
    needed = sum(estimate.total for estimate in in_ram)
    if budget.ram is not None and needed > HEADROOM * budget.ram:
        problems += [
            (
                estimate.key,
                f"{estimate.describe()} in RAM, of the {_gib(needed)} the roles need there together, but this "
                f"machine has {_gib(budget.ram)} available ({HEADROOM:.0%} of it may be taken); change "
                f"{', '.join(estimate.remedies)}",
            )
            for estimate in in_ram
        ]
    for estimate in estimates:
        if not estimate.on_gpu or budget.gpu is None:
            continue
        available = estimate.gpu_share * budget.gpu
        if estimate.per_process > HEADROOM * available:
            problems.append(
                (
                    estimate.key,
                    f"{estimate.describe()} on GPU, but a process of it has {_gib(available)} of its GPU "
                    f"({estimate.gpu_share:g} of {_gib(budget.gpu)}; {HEADROOM:.0%} of it may be taken); change "
                    f"{', '.join(estimate.remedies)}",
                )
            )
    return problems


def memory_note(cfg: PPOConfig) -> str:
    """The estimate in one line, for the run's start-up log."""
    estimates, missing = estimate_memory(cfg)
    budget = local_budget(cfg, needs_gpu=any(estimate.on_gpu for estimate in estimates))
    roles = [
        f"{estimate.role} {_gib(estimate.per_process)}"
        + (f" x {estimate.processes}" if estimate.processes > 1 else "")
        + (" on GPU" if estimate.on_gpu else " in RAM")
        for estimate in estimates
    ]
    in_ram = sum(estimate.total for estimate in estimates if not estimate.on_gpu)
    available = f"; {_gib(in_ram)} of {_gib(budget.ram)} available RAM" if budget.ram is not None else ""
    unknown = f"; not estimated: {', '.join(missing)}" if missing else ""
    return f"memory estimate (weights, gradients, AdamW state): {', '.join(roles) or 'none'}{available}{unknown}"
