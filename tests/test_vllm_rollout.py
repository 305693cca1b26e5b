"""The vLLM rollout engine.

CPU tests (always run): the config rejects ``rollout.name=vllm`` without vLLM or a GPU, naming the key;
the module imports without vLLM; the pure pieces the engine is built from (the conversion of token
lists into the batch, request seeds, sampling and engine arguments, the weight-bucket transport) are
checked with plain Python values, the conversion also against the transformers engine's own batch.

GPU tests (``-m gpu``, run by ``scripts/gpu_check.sh``; skipped without vLLM or CUDA) run a real vLLM
engine on a tiny Llama next to the transformers engine on the same GPU, both in float32:

* greedy outputs of the two engines are identical, and their log-probs agree within
  ``LOG_PROB_TOLERANCE``;
* sampled log-probs equal the actor's recomputation ``log softmax(logits / temperature)`` within
  ``LOG_PROB_TOLERANCE`` (and differ from the unscaled ones, so the temperature really is applied);
* the sampling seed depends only on (seed, step), ``n``/``top_k``/``top_p``/``max_response_length``
  are honoured;
* a weight update from ``ActorWorker.prepare_weights`` changes the engine's greedy output to the one
  the transformers engine gives with the same weights, and stamps its version;
* the engine runs as the run's Ray rollout actor (``start_workers``) through the weight_sync stage.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppoflow.configs import ConfigError, load_config, rules
from ppoflow.workers.models import load_tokenizer
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams, step_seed
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
    rollout_batch,
    sampling_kwargs,
)
from ppoflow.workers.weight_sync import TensorSlot, WeightUpdate, _raw_bytes, plan_buckets

REPO = Path(__file__).resolve().parents[1]
EOS, PAD = 2, 0
LOG_PROB_TOLERANCE = 1e-3
"""Absolute tolerance between vLLM's log-probs and the transformers ones (both float32; kernel
differences on the tiny model are expected around 1e-5, a wrong temperature or position is > 1e-2)."""

GPU_OVERRIDES = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.resources.num_gpus=1",
    "rollout.n_gpus_per_node=1",
]


def problems_of(overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config("grpo_tiny", overrides)
    for key, message in caught.value.problems:
        assert f"  {key}: {message}" in str(caught.value)
    return caught.value.problems


@pytest.fixture
def fake_vllm(monkeypatch):
    """Pretend a supported vLLM and a CUDA GPU are present, for the config rules only (nothing runs)."""
    monkeypatch.setattr(rules, "installed_vllm_version", lambda: "0.11.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# ------------------------------------------------------------------------------ config rules (CPU)


@pytest.mark.skipif(rules.installed_vllm_version() is not None, reason="vllm is installed here")
def test_vllm_without_vllm_installed_fails_at_config_time():
    problems = problems_of(GPU_OVERRIDES)
    assert any(
        key == "actor_rollout_ref.rollout.name" and "vllm is not installed" in message and "ppoflow[vllm]" in message
        for key, message in problems
    )


def test_vllm_without_a_cuda_gpu_fails_at_config_time(monkeypatch):
    monkeypatch.setattr(rules, "installed_vllm_version", lambda: "0.11.0")
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
    monkeypatch.setattr(rules, "installed_vllm_version", lambda: "0.9.2")
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
    return _prompt_batch(cpu_cfg, 3)


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
    seeds = request_seeds(seed=7, step=3, prompts=4, n=3)
    base = step_seed(7, 3) % SEED_SPACE
    assert seeds == [base, base + 3, base + 6, base + 9]
    rows = [seed + j for seed in seeds for j in range(3)]  # vLLM seeds sample j of a request with seed + j
    assert rows == [base + row for row in range(12)] and max(rows) < 2**63
    assert request_seeds(7, 3, 4, 3) == seeds and request_seeds(7, 4, 4, 3) != seeds
    assert request_seeds(8, 3, 4, 3) != seeds


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
            "actor_rollout_ref.model.dtype=bfloat16",
        ],
    )
    kwargs = engine_kwargs(cfg)
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["tensor_parallel_size"] == 2
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_model_len"] == 8 + 3
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


# ----------------------------------------------------------------------------- GPU checks


def _prompt_batch(cfg, count: int):
    from ppoflow.data.datasets import ensure_datasets, load_prompt_dataset

    ensure_datasets(cfg.data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
    rows = list(range(count))
    return dataset.batch(rows, [f"u{row}" for row in rows], tokenizer.pad_token_id).exclude(
        "uid", "data_source", "ground_truth"
    )


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """vLLM and a CUDA GPU, or skip."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return tmp_path_factory.mktemp("vllm")


def _build_model(path: Path, seed: int) -> str:
    """The tiny Llama with 64-wide attention heads (vLLM's attention kernels do not all take 16)."""
    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.workers.models import build_tiny_model

    build_tiny_model(
        str(path),
        TinyModelConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            seed=seed,
        ),
    )
    return str(path)


@pytest.fixture(scope="module")
def gpu_overrides(gpu) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={_build_model(gpu / 'model', seed=0)}",
        "actor_rollout_ref.model.build=null",
        f"data.train_files={gpu}/data/train.parquet",
        f"data.val_files={gpu}/data/val.parquet",
        "data.synthetic.train_rows=64",
        "data.synthetic.val_rows=8",
        "data.max_response_length=16",
        "data.max_prompt_length=24",  # room for the long prompts of the weight-update check
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.2",
        "actor_rollout_ref.actor.resources.num_gpus=1",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={gpu}/run",
        "actor_rollout_ref.model.dtype=float32",
    ] + GPU_OVERRIDES


@pytest.fixture(scope="module")
def gpu_cfg(gpu_overrides):
    return load_config("grpo_tiny", gpu_overrides)


@pytest.fixture(scope="module")
def gpu_prompts(gpu_cfg):
    return _prompt_batch(gpu_cfg, 6)


@pytest.fixture(scope="module")
def engine(gpu_cfg):
    """One vLLM engine for the module (eager, no compilation: the checks are about results, not speed)."""
    worker = VLLMRolloutWorker(gpu_cfg, enforce_eager=True, compilation_config=0)
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def hf_engine(gpu_cfg):
    return HFRolloutWorker(gpu_cfg)  # on the GPU: rollout.resources.num_gpus=1


def _long_prompts(prompts, pad_token_id: int, length: int = 17):
    """Each prompt repeated to at least ``length`` tokens: over 16, so vLLM's prefix cache keeps its first block."""
    from tensordict import TensorDict

    tokens = [row[mask].tolist() for row, mask in zip(prompts["prompts"], prompts["prompt_mask"])]
    rows = [row * -(-length // len(row)) for row in tokens]
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in rows])
    return TensorDict({"prompts": ids, "prompt_mask": mask}, batch_size=[len(rows)])


def _greedy(cfg, n: int = 2) -> SamplingParams:
    return dataclasses.replace(SamplingParams.for_training(cfg), do_sample=False, n=n)


@pytest.mark.gpu
def test_vllm_generate_returns_the_rollout_contract(gpu_cfg, gpu_prompts, engine, hf_engine):
    sampling = SamplingParams.for_training(gpu_cfg)
    batch = engine.generate(gpu_prompts, step=1, sampling=sampling)
    reference = hf_engine.generate(gpu_prompts, step=1, sampling=sampling)
    n, width, count = sampling.n, gpu_cfg.data.max_response_length, gpu_prompts.batch_size[0]
    assert batch.batch_size == reference.batch_size == torch.Size([count * n])
    assert set(batch.keys()) == set(reference.keys())
    for name in batch.keys():  # noqa: SIM118 (iterating a TensorDict walks its rows)
        assert batch[name].dtype == reference[name].dtype and batch[name].shape == reference[name].shape, name
        assert batch[name].device == reference[name].device, name
    assert batch["responses"].shape == (count * n, width)
    assert torch.equal(batch["group_index"], torch.arange(count).repeat_interleave(n))
    assert torch.equal(batch["prompts"][::n], gpu_prompts["prompts"])  # prompt-major rows
    assert torch.equal(batch["prompt_mask"][::n], gpu_prompts["prompt_mask"])
    assert (batch["weight_version"] == 0).all()
    eos, pad = engine.eos_token_id, engine.pad_token_id
    for tokens, mask in zip(batch["responses"].tolist(), batch["response_mask"].tolist()):
        valid = sum(mask)
        assert mask == [True] * valid + [False] * (width - valid) and valid >= 1
        assert eos not in tokens[: valid - 1] and (valid == width or tokens[valid - 1] == eos)
        assert tokens[valid:] == [pad] * (width - valid)
    assert (batch["rollout_log_probs"][~batch["response_mask"]] == 0).all()
    assert (batch["rollout_log_probs"][batch["response_mask"]] < 0).all()


@pytest.mark.gpu
def test_greedy_outputs_and_log_probs_equal_the_transformers_engine(gpu_cfg, gpu_prompts, engine, hf_engine):
    sampling = _greedy(gpu_cfg, n=2)
    ours = engine.generate(gpu_prompts, step=1, sampling=sampling)
    theirs = hf_engine.generate(gpu_prompts, step=1, sampling=sampling)
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.equal(ours["response_mask"], theirs["response_mask"])
    torch.testing.assert_close(ours["rollout_log_probs"], theirs["rollout_log_probs"], atol=LOG_PROB_TOLERANCE, rtol=0)


@pytest.mark.gpu
def test_sampled_log_probs_are_the_actors_at_the_sampling_temperature(gpu_overrides, gpu_prompts, engine):
    from ppoflow.workers.training.policy import ActorWorker

    cfg = load_config("grpo_tiny", gpu_overrides + ["actor_rollout_ref.rollout.temperature=0.7"])
    batch = engine.generate(gpu_prompts, step=2, sampling=SamplingParams.for_training(cfg))
    mask = batch["response_mask"]
    recomputed = ActorWorker(cfg).compute_log_prob(batch)["log_probs"]  # log softmax(logits / 0.7)
    torch.testing.assert_close(batch["rollout_log_probs"][mask], recomputed[mask], atol=LOG_PROB_TOLERANCE, rtol=0)
    unscaled = ActorWorker(load_config("grpo_tiny", gpu_overrides)).compute_log_prob(batch)["log_probs"]
    assert (batch["rollout_log_probs"][mask] - unscaled[mask]).abs().max() > 10 * LOG_PROB_TOLERANCE


@pytest.mark.gpu
def test_samples_depend_only_on_seed_and_step(gpu_cfg, gpu_prompts, engine):
    sampling = SamplingParams.for_training(gpu_cfg)
    first = engine.generate(gpu_prompts, step=3, sampling=sampling)
    engine.generate(gpu_prompts[:2], step=4, sampling=sampling)  # other requests in between change nothing
    again = engine.generate(gpu_prompts, step=3, sampling=sampling)
    assert torch.equal(first["responses"], again["responses"])
    torch.testing.assert_close(first["rollout_log_probs"], again["rollout_log_probs"], atol=1e-5, rtol=0)
    assert not torch.equal(first["responses"], engine.generate(gpu_prompts, step=5, sampling=sampling)["responses"])
    reseeded = dataclasses.replace(sampling, seed=sampling.seed + 1)
    assert not torch.equal(first["responses"], engine.generate(gpu_prompts, step=3, sampling=reseeded)["responses"])
    groups = first["responses"].view(gpu_prompts.batch_size[0], sampling.n, -1)
    assert any(len({tuple(row) for row in group.tolist()}) > 1 for group in groups)  # the n samples differ


@pytest.mark.gpu
def test_n_top_k_top_p_and_max_length_are_honoured(gpu_cfg, gpu_prompts, engine):
    sampling = SamplingParams.for_training(gpu_cfg)
    greedy = engine.generate(gpu_prompts, step=1, sampling=dataclasses.replace(sampling, do_sample=False))
    for truncation in ({"top_k": 1}, {"top_p": 1e-4}):  # either keeps only the most likely token: greedy
        truncated = engine.generate(gpu_prompts, step=1, sampling=dataclasses.replace(sampling, **truncation))
        assert torch.equal(truncated["responses"], greedy["responses"]), truncation
    short = engine.generate(gpu_prompts, step=1, sampling=dataclasses.replace(sampling, n=3, max_new_tokens=5))
    assert short["responses"].shape == (gpu_prompts.batch_size[0] * 3, 5)
    assert torch.equal(short["group_index"], torch.arange(gpu_prompts.batch_size[0]).repeat_interleave(3))


@pytest.mark.gpu
def test_weight_update_reaches_the_running_engine(gpu, gpu_cfg, gpu_prompts, engine):
    """Long prompts: their first KV block sits in vLLM's prefix cache after ``before``; an update that
    left it there would mix old-weight keys/values into ``after``."""
    from ppoflow.workers.models import load_causal_lm
    from ppoflow.workers.training.policy import ActorWorker

    sampling = _greedy(gpu_cfg)
    prompts = _long_prompts(gpu_prompts, engine.pad_token_id)
    lengths = prompts["prompt_mask"].sum(dim=1)
    assert int(lengths.min()) > 16 and int(lengths.max()) <= gpu_cfg.data.max_prompt_length
    before = engine.generate(prompts, step=1, sampling=sampling)
    actor = ActorWorker(gpu_cfg)
    other = load_config("grpo_tiny", [f"actor_rollout_ref.model.path={_build_model(gpu / 'other', seed=1)}"])
    actor.model.load_state_dict(load_causal_lm(other.actor_rollout_ref.model).state_dict())  # "trained" weights
    actor.weight_version = 3
    update = actor.prepare_weights()
    assert engine.apply_weights(update) == 3
    after = engine.generate(prompts, step=1, sampling=sampling)
    reference = HFRolloutWorker(gpu_cfg)
    assert reference.apply_weights(update) == 3
    expected = reference.generate(prompts, step=1, sampling=sampling)
    assert not torch.equal(after["responses"], before["responses"])
    assert torch.equal(after["responses"], expected["responses"])
    torch.testing.assert_close(
        after["rollout_log_probs"], expected["rollout_log_probs"], atol=LOG_PROB_TOLERANCE, rtol=0
    )
    assert (after["weight_version"] == 3).all()

    original = ActorWorker(gpu_cfg)  # and back: the initial weights give the initial outputs again
    assert engine.apply_weights(original.prepare_weights()) == 0
    assert torch.equal(engine.generate(prompts, step=1, sampling=sampling)["responses"], before["responses"])


@pytest.mark.gpu
def test_vllm_engine_as_the_runs_ray_rollout_actor(gpu_overrides, gpu_prompts, request):
    """start_workers puts the vLLM engine in the rollout actor; weight_sync moves the actor's weights in."""
    from ppoflow.tasks.weight_sync import weight_sync
    from ppoflow.workers.launcher import start_workers

    request.getfixturevalue("ray_local")  # only once the GPU checks apply (a session fixture would start first)

    cfg = load_config(
        "grpo_tiny",
        gpu_overrides
        + ["actor_rollout_ref.rollout.resources.num_gpus=0.5", "actor_rollout_ref.actor.resources.num_gpus=0.5"],
    )
    workers = start_workers(cfg)
    try:
        sampling = _greedy(cfg)
        before = workers.rollout.generate(gpu_prompts, step=1, sampling=sampling)
        weight_sync.fn(workers, False)
        after = workers.rollout.generate(gpu_prompts, step=1, sampling=sampling)
        assert torch.equal(before["responses"], after["responses"]) and after["weight_version"].eq(0).all()
        assert before.batch_size[0] == gpu_prompts.batch_size[0] * sampling.n
    finally:
        workers.shutdown()
