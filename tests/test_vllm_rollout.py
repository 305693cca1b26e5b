"""The vLLM rollout engine, on the CPU (always run): the config rejects ``rollout.name=vllm`` without vLLM or a
GPU, naming the key; the module imports without vLLM; the pure pieces the engine is built from (the conversion
of token lists into the batch, request seeds, sampling and engine arguments, the weight-bucket transport) are
checked with plain Python values, the conversion also against the transformers engine's own batch. The GPU
checks are in tests/test_vllm_rollout_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppoflow.configs import ConfigError, load_config, rules_vllm
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams, rollout_batch, step_seed
from ppoflow.workers.rollout.vllm_worker import (
    LOGPROBS_MODE,
    SEED_SPACE,
    WORKER_EXTENSION,
    VLLMRolloutWorker,
    VLLMWeightLoader,
    bucket_bytes,
    bucket_tensors,
    engine_kwargs,
    request_seeds,
    sampling_kwargs,
)
from ppoflow.workers.weight_sync import TensorSlot, WeightUpdate, _raw_bytes, plan_buckets
from tests.vllm_helpers import GPU_OVERRIDES, prompt_batch

REPO = Path(__file__).resolve().parents[1]
EOS, PAD = 2, 0


def problems_of(overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config("grpo_tiny", overrides)
    for key, message in caught.value.problems:
        assert f"  {key}: {message}" in str(caught.value)
    return caught.value.problems


@pytest.fixture
def fake_vllm(monkeypatch):
    """Pretend a supported vLLM and a CUDA GPU are present, for the config rules only (nothing runs)."""
    monkeypatch.setattr(rules_vllm, "installed_vllm_version", lambda: "0.11.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# ------------------------------------------------------------------------------ config rules (CPU)


@pytest.mark.skipif(rules_vllm.installed_vllm_version() is not None, reason="vllm is installed here")
def test_vllm_without_vllm_installed_fails_at_config_time():
    problems = problems_of(GPU_OVERRIDES)
    assert any(
        key == "actor_rollout_ref.rollout.name" and "vllm is not installed" in message and "ppoflow[vllm]" in message
        for key, message in problems
    )


def test_vllm_without_a_cuda_gpu_fails_at_config_time(monkeypatch):
    monkeypatch.setattr(rules_vllm, "installed_vllm_version", lambda: "0.11.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert problems_of(GPU_OVERRIDES) == [
        (
            "actor_rollout_ref.rollout.name",
            (
                "vllm generates on CUDA GPUs but torch.cuda.is_available() is false "
                "on this machine; use actor_rollout_ref.rollout.name=hf"
            ),
        )
    ]


def test_vllm_without_reserved_gpus_fails_at_config_time(fake_vllm):
    ((key, message),) = problems_of(["actor_rollout_ref.rollout.name=vllm"])  # resources.num_gpus: 0
    assert key == "actor_rollout_ref.rollout.resources.num_gpus" and "runs on GPUs" in message


def test_vllm_config_rules_on_version_parallelism_and_weight_sync(fake_vllm, monkeypatch):
    ((key, message),) = problems_of(
        GPU_OVERRIDES + ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "rollout.n_gpus_per_node=2"]
    )
    assert key == "actor_rollout_ref.rollout.tensor_model_parallel_size" and "num_gpus=1" in message
    ((key, message),) = problems_of(GPU_OVERRIDES + ["actor_rollout_ref.rollout.weight_sync.backend=gloo"])
    assert key == "actor_rollout_ref.rollout.weight_sync.backend" and "object_store" in message
    monkeypatch.setattr(rules_vllm, "installed_vllm_version", lambda: "0.9.2")
    ((key, message),) = problems_of(GPU_OVERRIDES)
    assert key == "actor_rollout_ref.rollout.name" and "vllm>=0.10.2" in message


def test_vllm_config_loads_and_selects_the_vllm_worker(fake_vllm):
    from ppoflow.workers.launcher import rollout_worker_class

    cfg = load_config("grpo_tiny", GPU_OVERRIDES + ["actor_rollout_ref.rollout.resources.num_gpus=0.5"])
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert rollout_worker_class(cfg) is VLLMRolloutWorker
    assert rollout_worker_class(load_config("grpo_tiny")) is HFRolloutWorker


def test_module_imports_without_importing_vllm():
    code = (
        "import sys, workers.rollout.vllm_worker, workers.launcher, configs; "
        "from configs import load_config; load_config('grpo_tiny'); "
        "assert 'vllm' not in sys.modules, 'vllm was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    module, name = WORKER_EXTENSION.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name) is VLLMWeightLoader
    assert all(attr.startswith("ppoflow_") for attr in vars(VLLMWeightLoader) if not attr.startswith("__"))


# -------------------------------------------------------------- the batch conversion (CPU, pure)


def test_conversion_with_eos_in_the_middle_no_eos_and_nothing_after_eos():
    fields = rollout_batch(
        [[5, 6, EOS, 7, 8], [5, 6, 7, 8, 9], [EOS], [5, 6], []],
        [[-1.0, -2.0, -3.0, -4.0, -5.0], [-0.1, -0.2, -0.3, -0.4, -0.5], [-0.5], [-1.5, -2.5], []],
        width=5,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    assert fields["responses"].dtype == torch.int64 and fields["response_mask"].dtype == torch.bool
    assert fields["rollout_log_probs"].dtype == torch.float32
    assert fields["responses"].tolist() == [
        [5, 6, EOS, PAD, PAD],  # after the first EOS: padding, masked
        [5, 6, 7, 8, 9],  # no EOS, full width: all valid
        [EOS, PAD, PAD, PAD, PAD],  # EOS first: only the EOS is valid
        [5, 6, PAD, PAD, PAD],  # stopped short without EOS
        [PAD] * 5,
    ]  # nothing generated
    assert fields["response_mask"].tolist() == [
        [True, True, True, False, False],
        [True] * 5,
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False] * 5,
    ]
    torch.testing.assert_close(
        fields["rollout_log_probs"],
        torch.tensor(
            [
                [-1.0, -2.0, -3.0, 0, 0],
                [-0.1, -0.2, -0.3, -0.4, -0.5],
                [-0.5, 0, 0, 0, 0],
                [-1.5, -2.5, 0, 0, 0],
                [0] * 5,
            ]
        ),
    )


def test_conversion_rejects_inconsistent_lists():
    with pytest.raises(ValueError, match="exceed the response width"):
        rollout_batch([[5, 6, 7]], [[-1.0, -1.0, -1.0]], width=2, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        rollout_batch([[5, 6]], [[-1.0]], width=4, eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="1 token lists but 2 log-prob lists"):
        rollout_batch([[5]], [[-1.0], [-1.0]], width=4, eos_token_id=EOS, pad_token_id=PAD)


@pytest.fixture
def cpu_cfg(tiny_overrides):
    return load_config("grpo_tiny", tiny_overrides + ["data.max_response_length=6"])


@pytest.fixture
def cpu_prompts(cpu_cfg):
    return prompt_batch(cpu_cfg, 3)


def test_conversion_reproduces_the_transformers_engine_batch(cpu_cfg, cpu_prompts):
    """The HF engine's own tokens and log-probs, as lists cut at the end of each response, convert back
    into exactly its response fields: same padding, masks and zeros."""
    hf = HFRolloutWorker(cpu_cfg)
    batch = hf.generate(cpu_prompts, step=1, sampling=SamplingParams.for_training(cpu_cfg))
    lengths = batch["response_mask"].sum(dim=1).tolist()
    fields = rollout_batch(
        [row[:length] for row, length in zip(batch["responses"].tolist(), lengths)],
        [row[:length] for row, length in zip(batch["rollout_log_probs"].tolist(), lengths)],
        width=cpu_cfg.data.max_response_length,
        eos_token_id=hf.tokenizer.eos_token_id,
        pad_token_id=hf.tokenizer.pad_token_id,
    )
    for name, value in fields.items():
        assert value.dtype == batch[name].dtype and torch.equal(value, batch[name]), name


# ------------------------------------------------------- requests and engine arguments (CPU, pure)


def test_request_seeds_give_every_row_its_own_seed_from_seed_and_step():
    seeds = request_seeds(seed=7, step=3, positions=range(4), n=3)
    base = step_seed(7, 3) % SEED_SPACE
    assert seeds == [base, base + 3, base + 6, base + 9]
    rows = [seed + j for seed in seeds for j in range(3)]  # vLLM seeds sample j of a request with seed + j
    assert rows == [base + row for row in range(12)] and max(rows) < 2**63
    assert request_seeds(7, 3, range(4), 3) == seeds and request_seeds(7, 4, range(4), 3) != seeds
    assert request_seeds(8, 3, range(4), 3) != seeds
    assert request_seeds(7, 3, [3, 1], 3) == [seeds[3], seeds[1]]  # a colocated rank's share: the batch's seeds


def test_sampling_arguments_map_the_config():
    cfg = load_config("grpo_tiny", ["actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.top_p=0.9"])
    training = SamplingParams.for_training(cfg)
    kwargs = sampling_kwargs(training, eos_token_id=EOS)
    assert kwargs == {
        "n": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 3,
        "logprobs": 0,
        "stop_token_ids": [EOS],
        "ignore_eos": False,
        "detokenize": False,
    }
    assert sampling_kwargs(dataclasses.replace(training, top_k=0), eos_token_id=EOS)["top_k"] == -1
    assert sampling_kwargs(dataclasses.replace(training, top_k=5), eos_token_id=EOS)["top_k"] == 5
    greedy = sampling_kwargs(SamplingParams.for_validation(cfg), eos_token_id=EOS)
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0 and "top_k" not in greedy


def test_engine_arguments_map_the_config():
    cfg = load_config(
        "grpo_tiny",
        [
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.dtype=float16",
        ],
    )
    kwargs = engine_kwargs(cfg)
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["tensor_parallel_size"] == 2
    assert kwargs["dtype"] == "float16" and kwargs["max_model_len"] == 8 + 3
    assert kwargs["logprobs_mode"] == LOGPROBS_MODE == "processed_logprobs"
    assert kwargs["worker_extension_cls"] == WORKER_EXTENSION and kwargs["generation_config"] == "vllm"
    assert kwargs["model"] == cfg.actor_rollout_ref.model.path


# ------------------------------------------------------------- weight transport (CPU, pure)


def test_weight_buckets_round_trip_through_bytes():
    """What apply_weights sends (bytes in the packed layout) is what the worker extension unpacks,
    whatever the dtypes (bfloat16, a misaligned odd-sized int8 before a float32) and bucket split."""
    state = {
        "embed.weight": torch.randn(5, 3, dtype=torch.bfloat16),
        "odd": torch.arange(3, dtype=torch.int8),
        "layer.weight": torch.randn(4, 4),
        "empty": torch.zeros(0),
        "bias": torch.randn(7, dtype=torch.float16),
    }
    for bucket_size in (64, 10_000):
        layouts = plan_buckets(state.items(), bucket_size)
        restored = {}
        for layout in layouts:
            packed = bucket_bytes(layout, [_raw_bytes(state[slot.name]) for slot in layout])
            slots = [(slot.name, slot.dtype, slot.shape, slot.offset, slot.nbytes) for slot in layout]
            restored.update(bucket_tensors(torch.frombuffer(bytearray(packed), dtype=torch.uint8), slots))
        assert restored.keys() == state.keys()
        for name, tensor in state.items():
            assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    with pytest.raises(ValueError, match="bytes for a slot"):
        bucket_bytes([TensorSlot("x", "float32", (2,), 0, 8)], [_raw_bytes(torch.zeros(3))])


def test_actor_updates_round_trip_through_the_vllm_transport(cpu_cfg):
    from ppoflow.workers.training.policy import ActorWorker

    actor = ActorWorker(cpu_cfg)
    update = actor.prepare_weights()
    restored = {}
    for layout, payload in zip(update.layouts, update.payloads):
        packed = bucket_bytes(layout, payload)
        restored.update(
            bucket_tensors(
                torch.frombuffer(bytearray(packed), dtype=torch.uint8),
                [(s.name, s.dtype, s.shape, s.offset, s.nbytes) for s in layout],
            )
        )
    state = actor.model.state_dict()
    assert restored.keys() == state.keys()
    assert all(torch.equal(restored[name], tensor) for name, tensor in state.items())


def test_collective_weight_sync_is_refused_with_a_clear_message():
    worker = VLLMRolloutWorker.__new__(VLLMRolloutWorker)  # no engine needed to refuse
    worker.backend = "nccl"
    with pytest.raises(NotImplementedError, match="weight_sync.backend=nccl is not supported with rollout.name=vllm"):
        worker.join_weight_group("group")
    with pytest.raises(NotImplementedError, match="object_store"):
        worker.apply_weights(WeightUpdate(1, [[TensorSlot("x", "float32", (1,), 0, 4)]]))


# ------------------------------------------------- a colocated vLLM engine (config rules, call protocol)

COLOCATED = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.hybrid_engine=true",
    "actor_rollout_ref.actor.resources.num_gpus=1",
    "trainer.n_gpus_per_node=1",
]


def test_sleep_mode_is_read_from_vllms_source_without_importing_it(tmp_path):
    source = tmp_path / "llm.py"
    source.write_text("class LLM:\n    def sleep(self, level: int = 1): ...\n    def wake_up(self, tags=None): ...\n")
    assert rules_vllm.sleep_mode_problem(source) is None
    source.write_text("class LLM:\n    def sleep(self, level: int = 1): ...\n    def wake_up(self): ...\n")
    assert "no wake_up() with sleep mode's arguments" in rules_vllm.sleep_mode_problem(source)
    source.write_text("class LLM:\n    def generate(self): ...\n")
    assert "no sleep() or wake_up()" in rules_vllm.sleep_mode_problem(source)


def test_a_colocated_vllm_engine_needs_the_actors_gpu_one_device_and_sleep_mode(fake_vllm, monkeypatch):
    monkeypatch.setattr(rules_vllm, "sleep_mode_problem", lambda: None)
    cfg = load_config("grpo_tiny", COLOCATED)
    assert cfg.colocated and cfg.actor_rollout_ref.rollout.resources.num_gpus == 0  # the actor's GPU serves it
    problems = dict(problems_of([*COLOCATED, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    assert "set it to 1" in problems["actor_rollout_ref.rollout.tensor_model_parallel_size"]
    problems = dict(problems_of([*COLOCATED[:2]]))
    assert "runs on the actor's GPU" in problems["actor_rollout_ref.actor.resources.num_gpus"]
    monkeypatch.setattr(rules_vllm, "sleep_mode_problem", lambda: "the installed vLLM's LLM has no sleep()")
    ((key, message),) = problems_of(COLOCATED)
    assert key == "actor_rollout_ref.hybrid_engine" and "sleeps while the ranks train" in message


def test_a_colocated_vllm_engine_sleeps_and_wakes_around_each_generation(monkeypatch, tiny_model):
    """The call protocol only, against a stand-in ``vllm`` module that records calls (no vLLM runs on a CPU): built
    with sleep mode and asleep at once; woken weights first, the rank's weights streamed in this process, the
    prefix cache reset, then the KV cache; asleep again after sampling. The real engine is unverified here."""
    import types

    from ppoflow.workers.rollout import vllm_worker

    calls = []

    class LLM:
        def __init__(self, **kwargs):
            calls.append(("init", kwargs["enable_sleep_mode"]))

        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags):
            calls.append(("wake_up", tuple(tags)))

        def collective_rpc(self, method, args):
            calls.append((method, [name for name, _ in args[0]]))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(vllm_worker, "vllm_problem", lambda: None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    cfg = load_config("grpo_tiny", [f"actor_rollout_ref.model.path={tiny_model}", "data.train_files=x.parquet"])
    engine = vllm_worker.ColocatedVLLMEngine(cfg)
    assert os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # the engine core in the rank's process
    engine.wake(iter([("a", torch.zeros(1)), ("b", torch.ones(1))]))
    engine.sleep()
    assert calls == [
        ("init", True),
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("ppoflow_load_tensors", ["a", "b"]),
        ("reset_prefix_cache",),
        ("wake_up", ("kv_cache",)),
        ("sleep", 1),
    ]
