"""The vLLM rollout engine: the same contract as :class:`ppoflow.workers.rollout.hf_worker.HFRolloutWorker`, on GPUs.

``actor_rollout_ref.rollout.name=vllm`` selects :class:`VLLMRolloutWorker` in :mod:`ppoflow.workers.launcher`; it serves
``generate``, ``apply_weights`` and ``join_weight_group`` like the transformers engine, so nothing else can tell
them apart. vLLM is an optional extra (``ppoflow[vllm]``) imported only when an engine is built, so this module
imports on a CPU machine; the config loader rejects ``rollout.name=vllm`` there
(:func:`ppoflow.configs.rules.cross_field_errors`). Weights load through :class:`VLLMWeightLoader`, the
``worker_extension_cls``; the batch conversion is
:func:`ppoflow.workers.rollout.sampling.sampled_batch`, shared with the transformers engine.
How it drives vLLM's ``LLM`` API (prompts, sampling, seeds, log-probs, weights): docs/vllm.md.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Sequence

import torch
from tensordict import TensorDict

from ppoflow.configs.rules_vllm import (
    VLLM_MIN_VERSION,
    installed_vllm_version,
    sleep_mode_problem,
    vllm_version_supported,
)
from ppoflow.configs.schema import PPOConfig
from ppoflow.workers.memory import gpu_memory, largest, process_memory
from ppoflow.workers.models import load_tokenizer, local_model_dir, set_up_worker_process
from ppoflow.workers.rollout.requests import TokenOutput
from ppoflow.workers.rollout.sampling import SamplingParams, outputs_batch, prompt_token_ids, step_seed
from ppoflow.workers.weight_sync import TensorSlot, WeightUpdate, _fetch

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's log-probs after temperature scaling (see the module docstring for the exact quantity)."""

WORKER_EXTENSION = "ppoflow.workers.rollout.vllm_worker.VLLMWeightLoader"
"""Qualified name of the class vLLM mixes into its GPU workers (``worker_extension_cls``)."""

SEED_SPACE = 2**62
"""Request seeds stay below ``SEED_SPACE + rows`` (well inside torch's 64-bit generator seeds)."""


def request_seeds(seed: int, step: int, positions: Sequence[int], n: int) -> list[int]:
    """One vLLM request seed per prompt, by its position in the step's batch; vLLM seeds sample ``j`` of a request
    with ``seed + j``, so trajectory row ``r`` (prompt-major) samples with ``base + r``, ``base`` depending only on
    (seed, step): a share of the batch (a colocated rank's) samples with the seeds the whole batch would."""
    base = step_seed(seed, step) % SEED_SPACE
    return [base + position * n for position in positions]


def sampling_kwargs(sampling: SamplingParams, *, eos_token_id: int) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (seed aside)."""
    common = {
        "max_tokens": sampling.max_new_tokens,
        "logprobs": 0,
        "stop_token_ids": [eos_token_id],
        "ignore_eos": False,
        "detokenize": False,
    }
    if sampling.greedy:  # vLLM allows only n=1 at temperature 0; generate() repeats the completion n times
        return {**common, "n": 1, "temperature": 0.0}
    return {
        **common,
        "n": sampling.n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
    }


def engine_kwargs(cfg: PPOConfig) -> dict:
    """Keyword arguments of ``vllm.LLM`` for this run's rollout engine."""
    model, rollout, data = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout, cfg.data
    return {
        "model": local_model_dir(model.path),
        "tokenizer": local_model_dir(model.tokenizer_path or model.path),
        "trust_remote_code": model.trust_remote_code,
        "dtype": rollout.dtype,
        "tensor_parallel_size": rollout.tensor_model_parallel_size,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "max_model_len": data.max_prompt_length + data.max_response_length,
        "seed": rollout.seed,
        "logprobs_mode": LOGPROBS_MODE,
        "generation_config": "vllm",
        "worker_extension_cls": WORKER_EXTENSION,
    }


class VLLMRolloutWorker:
    """Sampling with a vLLM engine on this actor's GPU(s); the interface of ``HFRolloutWorker``.

    ``overrides`` are extra ``vllm.LLM`` keyword arguments (tests and benchmarks pass e.g.
    ``enforce_eager=True``); the run itself builds it from the config alone.
    """

    def __init__(self, cfg: PPOConfig, **overrides):
        rollout = cfg.actor_rollout_ref.rollout
        set_up_worker_process(rollout.resources)
        version = installed_vllm_version()
        if version is None or not vllm_version_supported(version):
            raise ImportError(
                f"actor_rollout_ref.rollout.name=vllm needs vllm>={VLLM_MIN_VERSION} on the machine "
                f"that runs the rollout worker (found {version or 'none'}); install 'ppoflow[vllm]'"
            )
        from vllm import LLM

        self.tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        self.llm = LLM(**{**engine_kwargs(cfg), **overrides})
        self.weight_version = 0
        self.backend = rollout.weight_sync.backend
        self.vllm_version = version

    def generate(self, prompts: TensorDict, *, step: int, sampling: SamplingParams) -> TensorDict:
        """Sample ``sampling.n`` responses per prompt; rows come out prompt-major (p0 s0..s(n-1), p1 ...)."""
        ids = prompt_token_ids(prompts)
        outputs = sample_with_vllm(self.llm, ids, range(len(ids)), step=step, sampling=sampling, eos=self.eos_token_id)
        return outputs_batch(prompts, sampling, outputs, weight_version=self.weight_version, tokenizer=self.tokenizer)

    def apply_weights(self, update: WeightUpdate) -> int:
        """Load the actor's weights into the running engine, bucket by bucket (with LoRA the actor sends the
        merged full weights: vLLM's LoRA serving is not used); returns the version now served."""
        if update.layouts and not update.payloads:
            raise NotImplementedError(_COLLECTIVE_UNSUPPORTED.format(backend=self.backend))
        for layout, payload in zip(update.layouts, update.payloads):
            slots = [(slot.name, slot.dtype, tuple(slot.shape), slot.offset, slot.nbytes) for slot in layout]
            self.llm.collective_rpc("ppoflow_load_weights", args=(slots, bucket_bytes(layout, _fetch(payload))))
        if update.layouts:
            self.llm.reset_prefix_cache()  # KV blocks cached under the old weights must not be reused
        self.weight_version = update.version
        return self.weight_version

    def join_weight_group(self, group: str) -> None:
        raise NotImplementedError(_COLLECTIVE_UNSUPPORTED.format(backend=self.backend))

    def memory_stats(self) -> dict[str, float]:
        """This process's figures with the GPU peaks of the engine's workers (processes of their own, where
        the model and the KV cache live), the largest of each."""
        return largest([process_memory(), *self.llm.collective_rpc("ppoflow_memory_stats")])

    def shutdown(self) -> None:
        """Stop the engine's processes and free its GPU memory (the Ray actor's exit does this too)."""
        engine = getattr(self, "llm", None)
        core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


def sample_with_vllm(
    llm, prompt_ids: Sequence[Sequence[int]], positions: Sequence[int], *, step: int, sampling: SamplingParams, eos: int
) -> list[TokenOutput]:
    """``sampling.n`` trajectories of each prompt from a vLLM ``LLM``, prompt-major, seeded by the prompts' positions
    in the step's batch (:func:`request_seeds`)."""
    from vllm import SamplingParams as VLLMSamplingParams

    count = len(prompt_ids)
    kwargs = sampling_kwargs(sampling, eos_token_id=eos)
    if sampling.greedy:
        params = [VLLMSamplingParams(**kwargs) for _ in range(count)]
    else:
        params = [
            VLLMSamplingParams(**kwargs, seed=seed)
            for seed in request_seeds(sampling.seed, step, positions, sampling.n)
        ]
    requests = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
    outputs = llm.generate(requests, params, use_tqdm=False) if count else []
    if len(outputs) != count:
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {count} prompts")
    trajectories = []
    for output in outputs:
        completions = sorted(output.outputs, key=lambda completion: completion.index)
        if sampling.greedy:
            completions = completions * sampling.n
        if len(completions) != sampling.n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for n={sampling.n}")
        for completion in completions:
            finish = "length" if completion.finish_reason == "length" else "stop"
            trajectories.append(TokenOutput(list(completion.token_ids), _sampled_log_probs(completion), finish, (0, 0)))
    return trajectories


class ColocatedVLLMEngine:
    """vLLM as a colocated rank's engine (``hybrid_engine`` with ``rollout.name=vllm``), the way verl runs it: the
    engine core in the rank's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU, no tensor parallelism),
    built with ``enable_sleep_mode`` and put to sleep at once. :meth:`wake` wakes its weights' memory, loads the
    rank's full weights tensor by tensor through the model's ``load_weights`` in this process (no copy between
    processes) and wakes the KV cache; :meth:`sleep` sleeps at :data:`SLEEP_LEVEL`. Not run on any machine of the
    project yet: docs/vllm.md says what is unverified."""

    SLEEP_LEVEL = 1
    """vLLM's level 1: the weights offloaded to the CPU, the KV cache discarded (level 2 also drops buffers that
    some models keep outside their state dict, which a weight load does not restore)."""

    def __init__(self, cfg: PPOConfig, **overrides):
        problem = vllm_problem()
        if problem:
            raise ImportError(f"actor_rollout_ref.hybrid_engine with rollout.name=vllm: {problem}")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: weights load in place
        from vllm import LLM

        self.eos_token_id = load_tokenizer(cfg.actor_rollout_ref.model).eos_token_id
        self.llm = LLM(**{**engine_kwargs(cfg), "enable_sleep_mode": True, **overrides})
        self.llm.sleep(level=self.SLEEP_LEVEL)

    def wake(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Serve ``weights`` (the rank's full state dict, one tensor at a time)."""
        self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("ppoflow_load_tensors", args=(weights,))
        self.llm.reset_prefix_cache()  # KV blocks cached under the old weights must not be reused
        self.llm.wake_up(tags=["kv_cache"])

    def sample(
        self, prompt_ids: Sequence[Sequence[int]], positions: Sequence[int], *, step: int, sampling: SamplingParams
    ) -> list[TokenOutput]:
        return sample_with_vllm(self.llm, prompt_ids, positions, step=step, sampling=sampling, eos=self.eos_token_id)

    def sleep(self) -> None:
        self.llm.sleep(level=self.SLEEP_LEVEL)


def vllm_problem() -> str | None:
    """Why the installed vLLM cannot be a colocated engine (None when it can): it is missing or too old, or its
    ``LLM`` lacks ``sleep(level)`` and ``wake_up(tags)``."""
    version = installed_vllm_version()
    if version is None or not vllm_version_supported(version):
        return f"needs vllm>={VLLM_MIN_VERSION} (found {version or 'none'}); install 'ppoflow[vllm]'"
    return sleep_mode_problem()


_COLLECTIVE_UNSUPPORTED = (
    "actor_rollout_ref.rollout.weight_sync.backend={backend} is not supported with rollout.name=vllm: vLLM's GPU "
    "workers are processes of the engine, outside the Ray collective group that backend broadcasts in; set "
    "actor_rollout_ref.rollout.weight_sync.backend=object_store"
)


def _sampled_log_probs(completion) -> list[float]:
    """The log-prob of each sampled token from a vLLM ``CompletionOutput`` requested with ``logprobs=0``."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; the request must set logprobs=0")
    return [float(entry[token].logprob) for token, entry in zip(completion.token_ids, completion.logprobs)]


def bucket_bytes(layout: Sequence[TensorSlot], arrays: Sequence) -> bytes:
    """One bucket's tensors (raw byte arrays, one per slot) joined into the packed layout the slots describe.

    Plain ``bytes`` is what travels through ``collective_rpc``: its arguments are msgpack-encoded
    untyped on the way to vLLM's engine process, which carries bytes as they are (a NumPy array or a
    tensor would arrive as an undecoded (dtype, shape, buffer-index) triple).
    """
    if len(layout) != len(arrays):
        raise ValueError(f"a bucket of {len(layout)} slots came with {len(arrays)} arrays")
    for slot, raw in zip(layout, arrays):
        if len(memoryview(raw).cast("B")) != slot.nbytes:
            raise ValueError(f"{slot.name}: {len(memoryview(raw).cast('B'))} bytes for a slot of {slot.nbytes}")
    return b"".join(memoryview(raw).cast("B") for raw in arrays)


def bucket_tensors(
    bucket: torch.Tensor, slots: Sequence[tuple[str, str, Sequence[int], int, int]]
) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views into a flat ``uint8`` bucket (on any device) for ``(name, dtype, shape,
    offset, nbytes)`` slots; a slot not aligned to its element size is copied first."""
    weights = []
    for name, dtype, shape, offset, nbytes in slots:
        torch_dtype = getattr(torch, dtype)
        piece = bucket[offset : offset + nbytes]
        if offset % torch_dtype.itemsize:
            piece = piece.clone()
        weights.append((name, piece.view(torch_dtype).view(tuple(shape))))
    return weights


class VLLMWeightLoader:
    """Mixed into every vLLM GPU worker (``worker_extension_cls``); called through ``LLM.collective_rpc``.

    Its method names carry a ``ppoflow_`` prefix: vLLM refuses an extension whose attributes clash with
    the worker class's own.
    """

    def ppoflow_load_weights(self, slots: list, bucket: bytes) -> int:
        """Load one packed bucket (see :func:`bucket_bytes`) into the model: one host-to-GPU copy, then the
        model's ``load_weights`` with ``(name, tensor)`` views. Returns how many parameters it wrote."""
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only message buffer: only read, then copied
            host = torch.frombuffer(bucket, dtype=torch.uint8) if len(bucket) else torch.empty(0, dtype=torch.uint8)
        device_bucket = host.to(self.device)
        loaded = model.load_weights(weights=bucket_tensors(device_bucket, slots))
        torch.cuda.synchronize(self.device)
        return len(loaded) if loaded is not None else len(slots)

    def ppoflow_load_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load ``(name, tensor)`` pairs handed over in this process (a colocated engine: :class:`ColocatedVLLMEngine`),
        each copied to the GPU as it comes; returns how many it wrote."""
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        loaded = model.load_weights(weights=((name, tensor.to(self.device)) for name, tensor in weights))
        torch.cuda.synchronize(self.device)
        return len(loaded) if loaded is not None else 0

    def ppoflow_memory_stats(self) -> dict[str, float]:
        """This GPU worker's allocator peaks since the last call (:func:`~ppoflow.workers.memory.gpu_memory`)."""
        return gpu_memory()
