"""The config rules of ``rollout.name=vllm``: vLLM installed (a version with ``logprobs_mode``), a CUDA GPU here
unless the run joins a cluster, GPUs reserved for the engine, weights through the object store, and for a
colocated engine (``hybrid_engine``) vLLM's sleep mode; part of :func:`ppoflow.configs.rules.cross_field_errors`.
None of it imports vllm (slow): the version comes from package metadata, sleep mode from the source of its ``LLM``."""

from __future__ import annotations

import os
from pathlib import Path

from ppoflow.configs.schema import PPOConfig

VLLM_MIN_VERSION = "0.10.2"
"""Oldest vLLM the vllm engine runs on: its ``logprobs_mode`` engine argument (log-probs after temperature
scaling, see :mod:`ppoflow.workers.rollout.vllm_worker`) first shipped in 0.10.2."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, or None; reads package metadata only (importing vllm is slow)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def vllm_version_supported(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release >= Version(VLLM_MIN_VERSION).release
    except InvalidVersion:
        return True  # an unusual local build: let the engine itself decide


def sleep_mode_problem(llm_source: Path | None = None) -> str | None:
    """Why the installed vLLM's ``LLM`` (its source ``vllm/entrypoints/llm.py``, read, not imported: importing vllm
    is slow) cannot sleep and wake as a colocated engine must - ``sleep(level)`` and ``wake_up(tags)`` - or None."""
    import ast
    import importlib.util

    if llm_source is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            return "vllm is not installed"
        llm_source = Path(spec.origin).parent / "entrypoints" / "llm.py"
    try:
        tree = ast.parse(llm_source.read_text())
    except (OSError, SyntaxError) as error:
        return f"its LLM class could not be read ({llm_source}: {error})"
    methods = {
        node.name: {argument.arg for argument in node.args.args + node.args.kwonlyargs}
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "LLM"
        for node in cls.body
        if isinstance(node, ast.FunctionDef)
    }
    missing = [
        call for call, argument in (("sleep", "level"), ("wake_up", "tags")) if argument not in methods.get(call, ())
    ]
    if missing:
        calls = " or ".join(f"{call}()" for call in missing)
        return f"the installed vLLM's LLM has no {calls} with sleep mode's arguments"
    return None


def vllm_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``rollout.name=vllm`` needs vLLM installed, a CUDA GPU here and GPUs reserved for the rollout (colocated: the
    actor's, :func:`_colocated_errors`)."""
    import torch

    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    errors: list[tuple[str, str]] = []
    # Joining a Ray cluster, the engine runs on its GPU nodes: this machine (the driver) needs neither.
    local = not (cfg.ray.address or os.environ.get("RAY_ADDRESS"))
    version = installed_vllm_version() if local else VLLM_MIN_VERSION
    if version is None:
        errors.append(
            (
                f"{key}.name",
                "vllm is not installed; install the optional extra (pip install "
                "'ppoflow[vllm]') on a CUDA machine, or use actor_rollout_ref.rollout.name=hf",
            )
        )
    elif not vllm_version_supported(version):
        errors.append(
            (
                f"{key}.name",
                f"vllm {version} is installed but rollout.name=vllm needs "
                f"vllm>={VLLM_MIN_VERSION} (logprobs_mode); upgrade it or use rollout.name=hf",
            )
        )
    if local and not torch.cuda.is_available():
        errors.append(
            (
                f"{key}.name",
                "vllm generates on CUDA GPUs but torch.cuda.is_available() is false on "
                "this machine; use actor_rollout_ref.rollout.name=hf",
            )
        )
    if cfg.colocated:
        return errors + _colocated_errors(cfg, check_sleep_mode=local and version is not None)
    gpus, tp = rollout.resources.num_gpus, rollout.tensor_model_parallel_size
    if gpus == 0:
        errors.append(
            (
                f"{key}.resources.num_gpus",
                "rollout.name=vllm runs on GPUs; reserve them with "
                f"{key}.resources.num_gpus > 0 (= tensor_model_parallel_size), or use rollout.name=hf",
            )
        )
    elif tp > 1 and gpus < tp:
        errors.append(
            (
                f"{key}.tensor_model_parallel_size",
                f"{tp} GPUs of tensor parallelism but the rollout worker reserves {key}.resources.num_gpus={gpus:g}",
            )
        )
    if rollout.weight_sync.backend != "object_store":
        errors.append(
            (
                f"{key}.weight_sync.backend",
                f"{rollout.weight_sync.backend} is not supported with "
                "rollout.name=vllm (the engine's GPU workers are outside the Ray collective group); "
                "use object_store",
            )
        )
    return errors


def _colocated_errors(cfg: PPOConfig, *, check_sleep_mode: bool) -> list[tuple[str, str]]:
    """A colocated vLLM engine (:class:`~ppoflow.workers.rollout.vllm_worker.ColocatedVLLMEngine`) lives in each actor
    rank's process, on its one GPU: it needs the actor on GPUs, no tensor parallelism, and vLLM's sleep mode."""
    key, errors = "actor_rollout_ref.hybrid_engine", []
    if cfg.actor_rollout_ref.actor.resources.num_gpus == 0:
        errors.append(
            (
                "actor_rollout_ref.actor.resources.num_gpus",
                "a colocated vllm engine runs on the actor's GPU; reserve one per rank (num_gpus=1), or use "
                "actor_rollout_ref.rollout.name=hf",
            )
        )
    if cfg.actor_rollout_ref.rollout.tensor_model_parallel_size > 1:
        errors.append(
            (
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "a colocated vllm engine serves its rank's share on the rank's own GPU; set it to 1, or "
                "hybrid_engine=false for a tensor-parallel rollout of its own",
            )
        )
    problem = sleep_mode_problem() if check_sleep_mode else None
    if problem:
        errors.append(
            (key, f"a colocated vllm engine sleeps while the ranks train: {problem}; set hybrid_engine=false")
        )
    return errors
