"""Memory, measured and foreseen: each role process reports its peaks once a step (:class:`ReportsMemory`,
collected by :class:`MemoryReports` into verl's ``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb``,
``perf/cpu_memory_used_gb`` and ``perf/<role>/...``), and :func:`estimate_memory` counts, from the models'
``config.json`` alone, the bytes every role's copy of the weights, gradients and AdamW state needs, which
:func:`memory_problems` holds against the RAM and GPUs of a local run. Details: docs/architecture.md#memory.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import FSDPConfig, ModelConfig, PPOConfig, ResourcesConfig
from ppoflow.workers.models import builds_model, model_config

GIB = 1024**3

NODE_MEMORY = "cpu_memory_used_gb"
"""verl's ``perf/cpu_memory_used_gb``: the node's memory in use (psutil's ``virtual_memory().used``, MemTotal -
MemAvailable), which verl reads in the actor's update; reported as the actor saw it at the end of the step."""

VERL_NAMES = ("max_memory_allocated_gb", "max_memory_reserved_gb", NODE_MEMORY)
"""The figures verl reports from the actor under ``perf/<name>``."""


# ------------------------------------------------------------------------------------- measured


def gpu_memory() -> dict[str, float]:
    """The peaks of torch's CUDA allocator in this process since the last call (the largest over its devices),
    reset after reading; empty when the process has not used CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    devices = range(torch.cuda.device_count())
    stats = {
        "max_memory_allocated_gb": max(torch.cuda.max_memory_allocated(device) for device in devices) / GIB,
        "max_memory_reserved_gb": max(torch.cuda.max_memory_reserved(device) for device in devices) / GIB,
    }
    for device in devices:
        torch.cuda.reset_peak_memory_stats(device)
    return stats


def process_memory() -> dict[str, float]:
    """This process's figures since the last call: the GPU peaks (:func:`gpu_memory`), ``max_rss_gb``, its
    peak resident memory (Linux's VmHWM, reset after reading through ``/proc/self/clear_refs``; where the kernel
    refuses the reset, the peak since the process started), and the node's memory in use (:data:`NODE_MEMORY`).
    No CPU figures where there is no ``/proc`` (not Linux)."""
    stats = gpu_memory()
    if not os.path.exists("/proc/self/status"):
        return stats
    peak = _proc_kib("/proc/self/status", "VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # Linux >= 4.0: the peak restarts from the current resident size
    except OSError:
        pass
    used = _proc_kib("/proc/meminfo", "MemTotal") - _proc_kib("/proc/meminfo", "MemAvailable")
    return {**stats, "max_rss_gb": peak * 1024 / GIB, NODE_MEMORY: used * 1024 / GIB}


def _proc_kib(path: str, name: str) -> int:
    """The ``name:  N kB`` line of a /proc file, in KiB."""
    with open(path) as lines:
        return next(int(line.split()[1]) for line in lines if line.startswith(f"{name}:"))


class ReportsMemory:
    """Mixed into every role's worker class: :meth:`memory_stats`, this process's peaks since the last call."""

    def memory_stats(self) -> dict[str, float]:
        return process_memory()


def largest(replies: list[dict[str, float]]) -> dict[str, float]:
    """Figures of several processes of one role (data-parallel ranks, replicas) as one: the largest of each."""
    merged: dict[str, float] = {}
    for reply in replies:
        for name, value in reply.items():
            merged[name] = max(merged.get(name, value), value)
    return merged


def memory_metrics(by_role: dict[str, dict[str, float]]) -> dict[str, float]:
    """Step metrics from each role's figures: ``perf/<role>/<name>`` (the node's memory left out), and the
    actor's as verl names them (``perf/<name>``, :data:`VERL_NAMES`)."""
    metrics = {
        f"perf/{role}/{name}": value
        for role, stats in by_role.items()
        for name, value in stats.items()
        if name != NODE_MEMORY
    }
    actor = by_role.get("actor", {})
    metrics.update({f"perf/{name}": actor[name] for name in VERL_NAMES if name in actor})
    return metrics


LATE_WAIT_S = 0.5
"""How long the step end waits for a role still busy (then read one step later, without waiting)."""


class MemoryReports:
    """Every role's figures once a step, asked of all their processes at once (``roles``: name -> a role with
    ``start_memory_stats``, references of Ray calls). A Ray actor runs one call at a time, so a role busy at the
    end of a step (one_step_off's rollout, generating the next batch) answers only when it is done: it is waited
    for once, up to :data:`LATE_WAIT_S`, and from then on read at the next step without waiting. Its call, queued
    behind that generation, reports the peaks up to it - those of the batch the next step trains on."""

    def __init__(self, roles: dict[str, Any], get):
        self.roles, self.get = roles, get
        self.pending: dict[str, list] = {}
        self.late: set[str] = set()

    def collect(self) -> dict[str, float]:
        for name, role in self.roles.items():
            if name not in self.pending:
                self.pending[name] = role.start_memory_stats()
        waited = [ref for name, refs in self.pending.items() if name not in self.late for ref in refs]
        ready = set(_ready(waited, LATE_WAIT_S))
        ready |= set(_ready([ref for name in self.late for ref in self.pending[name]], 0.0))
        answered = [name for name, refs in self.pending.items() if ready.issuperset(refs)]
        self.late |= set(self.pending) - set(answered)
        replies = iter(self.get([ref for name in answered for ref in self.pending[name]]))
        by_role = {name: largest([next(replies) for _ in self.pending.pop(name)]) for name in answered}
        for name in self.late & set(answered):  # its next figures come with the next step
            self.pending[name] = self.roles[name].start_memory_stats()
        return memory_metrics(by_role)


def _ready(references: list, timeout_s: float) -> list:
    """Those of ``references`` whose values are ready, waiting up to ``timeout_s`` for all of them."""
    import ray

    if not references:
        return []
    ready, _ = ray.wait(references, num_returns=len(references), timeout=timeout_s, fetch_local=False)
    return ready


# ------------------------------------------------------------------------------------- foreseen

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
        unit = "replica" if self.role == "rollout" and self.processes > 1 else "rank"
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
        estimates.append(
            _trained(
                "actor",
                "actor_rollout_ref.actor",
                arr.model,
                policy,
                arr.actor,
                ranks,
                trains=not arr.model.lora,
                remedies=lora,
            )
        )
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
    return estimates, missing


def _rollout(cfg: PPOConfig, params: int) -> list[RoleMemory]:
    """The rollout's copies of the policy, in ``model.dtype``: none when colocated (it samples with the actor's),
    one per replica of the rollout service, vLLM's share of each of its GPUs (its weights split over the
    tensor-parallel GPUs), else one."""
    arr, key = cfg.actor_rollout_ref, "actor_rollout_ref.rollout"
    rollout, size = arr.rollout, _itemsize(arr.model.dtype)
    if cfg.colocated:
        return []
    on_gpu = rollout.resources.num_gpus > 0
    if rollout.name == "vllm":
        tensor_parallel = rollout.tensor_model_parallel_size
        remedies = (
            f"{key}.gpu_memory_utilization",
            f"{key}.tensor_model_parallel_size",
            "actor_rollout_ref.model.dtype",
        )
        weights = {"weights": -(-params // tensor_parallel) * size}
        return [RoleMemory("rollout", key, weights, tensor_parallel, True, rollout.gpu_memory_utilization, remedies)]
    replicas = rollout.num_replicas if rollout.mode == "async" else 1
    remedies = ("actor_rollout_ref.model.dtype",) + (("actor_rollout_ref.hybrid_engine",) if replicas == 1 else ())
    share = min(rollout.resources.num_gpus, 1.0) or 1.0
    return [RoleMemory("rollout", key, {"weights": params * size}, replicas, on_gpu, share, remedies)]


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
    ram = _proc_kib("/proc/meminfo", "MemAvailable") * 1024
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
