"""The vLLM rollout engine on a GPU (``-m gpu``, run by ``scripts/gpu_check.sh``; skipped without vLLM or CUDA):
a real vLLM engine on a tiny Llama next to the transformers engine on the same GPU, both in float32. What the
checks cover: docs/vllm.md, "GPU checks"."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ppoflow.configs import load_config
from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.rollout.vllm_worker import VLLMRolloutWorker
from tests.vllm_helpers import GPU_OVERRIDES, prompt_batch

LOG_PROB_TOLERANCE = 1e-3
"""Absolute tolerance between vLLM's log-probs and the transformers ones (both float32; kernel
differences on the tiny model are expected around 1e-5, a wrong temperature or position is > 1e-2)."""


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
    return prompt_batch(gpu_cfg, 6)


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
