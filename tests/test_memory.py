"""Memory made visible and checked: each process's peaks per report, freed memory given back at the end of each
worker stage (kept for reuse until then by jemalloc, the workers' allocator), the roles' figures as step metrics (a
busy role read a step later), the estimate of every copy from a model's config alone, and a layout that cannot
fit refused before anything loads (exit code 2, naming the keys). The end-to-end run's metrics:
tests/test_flow.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from tensordict import TensorDict
from transformers import LlamaConfig, LlamaForCausalLM

from ppoflow.configs import load_config
from ppoflow.workers import memory, memory_estimate, stage
from ppoflow.workers.launcher import JEMALLOC_CONF, allocator_env
from ppoflow.workers.memory import GIB, MemoryReports, ReportsMemory, memory_metrics, process_memory
from ppoflow.workers.memory_estimate import estimate_memory, parameter_count
from ppoflow.workers.models import load_value_model
from ppoflow.workers.roles import RayObjects, RayRole
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.training.colocated import ColocatedActorWorker
from tests.conftest import model_config
from tests.preflight_helpers import DEMO, assert_user_error, run_cli

TINY = {"vocab_size": 32, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
"""A Llama small enough to count by hand (tied embeddings, no biases):
embedding 32 x 8 = 256; per layer q, k, v, o 4 x 8 x 8 = 256, MLP 3 x 8 x 16 = 384, two norms 16: 656, twice 1312;
final norm 8. The critic drops the tied LM head and adds a scalar head with a bias: 8 + 1."""
TINY_PARAMETERS = 256 + 2 * (256 + 384 + 16) + 8
TINY_CRITIC_PARAMETERS = TINY_PARAMETERS + 8 + 1


def write_config(path, **values) -> str:
    """A model directory holding only a ``config.json`` (no weights, no tokenizer)."""
    path.mkdir(parents=True)
    config = LlamaConfig(**{**TINY, "tie_word_embeddings": True, "max_position_embeddings": 64, **values})
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return str(path)


# ------------------------------------------------------------------------------------------- measured


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_reports_its_peak_resident_memory_since_its_last_report():
    import psutil

    process_memory()  # the peak restarts here
    size = 256 * 1024**2
    held = bytearray(size)  # zero-filled: every page touched
    first = process_memory()
    del held
    process_memory()  # this window started with the buffer still held
    third = process_memory()
    rss_now = psutil.Process().memory_info().rss / GIB
    assert first["max_rss_gb"] >= rss_now + 0.9 * size / GIB  # the peak held the buffer (10% for page rounding)
    assert third["max_rss_gb"] < first["max_rss_gb"] - 0.9 * size / GIB  # reset: the buffer was gone all window
    assert abs(first["cpu_memory_used_gb"] - psutil.virtual_memory().used / GIB) < 0.5  # verl's figure (psutil's)
    assert "max_memory_allocated_gb" not in first  # this process never used CUDA


FREED_IN_THE_HEAP = """
import psutil, torch
from ppoflow.workers.memory import release_freed_memory
mapped = torch.empty(16 * 2**20, dtype=torch.uint8)
del mapped  # freeing a mapped block lifts glibc's threshold: later blocks of up to its size come from the heap
blocks = [torch.ones(8 * 2**20, dtype=torch.uint8) for _ in range(64)]  # 512 MiB in the heap, every page touched
pin = torch.ones(2**20, dtype=torch.uint8)  # above them (a tiny one would reuse a cached chunk): the heap's top stays
del blocks
held = psutil.Process().memory_info().rss
print(release_freed_memory(), (held - psutil.Process().memory_info().rss) / 2**20)
"""


def test_memory_freed_inside_the_heap_goes_back_to_the_system():
    released, mib = subprocess.run(  # a fresh process: its heap holds only what this scenario put there
        [sys.executable, "-c", FREED_IN_THE_HEAP], capture_output=True, text=True, check=True
    ).stdout.split()
    assert released == "True"
    assert float(mib) > 400  # of the 512 MiB freed (without the release: ~0)


KEPT_BY_JEMALLOC = """
import psutil, torch
from ppoflow.workers.memory import release_freed_memory
before = psutil.Process().memory_info().rss
blocks = [torch.ones(n * 2**20, dtype=torch.uint8) for n in (1, 2, 4, 8, 16) for _ in range(16)]  # 496 MiB
del blocks
kept = psutil.Process().memory_info().rss
print(release_freed_memory(), (kept - before) / 2**20, (kept - psutil.Process().memory_info().rss) / 2**20)
"""


def test_jemalloc_keeps_what_a_worker_frees_until_the_release_gives_it_back(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    env = {**os.environ, **allocator_env("jemalloc")}  # a local Ray's worker, as ppoflow starts them
    released, kept, given_back = subprocess.run(
        [sys.executable, "-c", KEPT_BY_JEMALLOC], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    assert released == "True"  # through jemalloc's mallctl, which only the preloaded library has
    assert float(kept) > 400  # of the 496 MiB freed, kept for reuse (glibc unmaps its blocks of 16 MiB at once)
    assert float(given_back) > 400


def test_the_allocator_is_jemalloc_unless_the_driver_preloads_its_own_or_asks_for_malloc(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    assert allocator_env("jemalloc")["MALLOC_CONF"] == "narenas:2"  # the user's settings
    monkeypatch.delenv("MALLOC_CONF")
    assert allocator_env("jemalloc")["MALLOC_CONF"] == JEMALLOC_CONF
    assert allocator_env("jemalloc")["LD_PRELOAD"].endswith("ray/core/libjemalloc.so")
    assert allocator_env("system") == {}
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so")
    assert allocator_env("jemalloc") == {}  # the workers inherit the driver's own


def test_a_worker_stage_gives_back_what_it_freed_when_it_ends_or_fails(monkeypatch):
    calls = []
    monkeypatch.setattr(stage, "release_freed_memory", lambda: calls.append("released"))

    @stage.worker_stage("rollout_generate")
    def generate(fail: bool) -> str:
        calls.append("ran")
        if fail:
            raise ValueError("boom")
        return "rollout"

    assert generate(False) == "rollout"
    with pytest.raises(ValueError, match="boom"):
        generate(True)
    assert calls == ["ran", "released", "ran", "released"]


def test_each_stage_of_a_worker_ends_in_a_release_the_updates_after_its_gradients_are_gone(monkeypatch, tiny_overrides):
    cfg = load_config("grpo_tiny", tiny_overrides)
    actor = ColocatedActorWorker(cfg)
    released = []  # the gradients at each release
    monkeypatch.setattr(
        stage, "release_freed_memory", lambda: released.append([p.grad for p in actor.model.parameters()])
    )
    digits = torch.randint(3, 13, (2, 5), generator=torch.Generator().manual_seed(0))
    prompts = TensorDict({"prompts": digits, "prompt_mask": torch.ones_like(digits, dtype=torch.bool)}, batch_size=[2])
    batch = actor.generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    batch["advantages"] = torch.randn(batch["responses"].shape) * batch["response_mask"]
    assert actor.update(batch, step=1).metrics["actor/grad_norm"] > 0
    assert len(released) == 3  # generate, compute_log_prob, update
    assert all(grad is None for grad in released[-1])  # the update's release comes after its last step freed them


def test_step_metrics_carry_verl_names_for_the_actor_and_every_role_under_its_own():
    actor = {"max_memory_allocated_gb": 3.0, "max_memory_reserved_gb": 4.0, "max_rss_gb": 2.0, "cpu_memory_used_gb": 9}
    assert memory_metrics({"actor": actor, "rollout": {"max_rss_gb": 1.5, "cpu_memory_used_gb": 9.5}}) == {
        "perf/max_memory_allocated_gb": 3.0,
        "perf/max_memory_reserved_gb": 4.0,
        "perf/cpu_memory_used_gb": 9,
        "perf/actor/max_memory_allocated_gb": 3.0,
        "perf/actor/max_memory_reserved_gb": 4.0,
        "perf/actor/max_rss_gb": 2.0,
        "perf/rollout/max_rss_gb": 1.5,
    }
    assert memory.largest([{"a": 1.0, "b": 5.0}, {"a": 2.0}]) == {"a": 2.0, "b": 5.0}  # over ranks


@pytest.mark.slow  # a worker kept busy on purpose (~9 s)
def test_a_busy_role_is_waited_for_once_then_read_a_step_later(ray_local, monkeypatch):
    import ray

    monkeypatch.setattr(memory, "LATE_WAIT_S", 2.0)
    objects = RayObjects()
    idle, busy = (ray.remote(ReportsMemory).options(num_cpus=0).remote() for _ in range(2))
    ray.get([idle.__ray_ready__.remote(), busy.__ray_ready__.remote()])
    reports = MemoryReports({"idle": RayRole(idle, objects), "busy": RayRole(busy, objects)}, objects.get)
    try:
        working = busy.__ray_call__.remote(lambda _: time.sleep(6.0))  # its report waits behind this call
        first = reports.collect()
        assert "perf/idle/max_rss_gb" in first and not any(name.startswith("perf/busy/") for name in first)
        assert reports.late == {"busy"}
        ray.get(working)
        second = reports.collect()  # the report queued behind the work, read without waiting
        assert second["perf/busy/max_rss_gb"] > 0 and "perf/idle/max_rss_gb" in second
        assert set(reports.pending) == {"busy"}  # its next report is already asked for
    finally:
        for handle in (idle, busy):
            ray.kill(handle)


# ------------------------------------------------------------------------------------------- foreseen


def test_parameters_are_counted_from_the_config_alone(tmp_path):
    path = write_config(tmp_path / "config_only")
    assert parameter_count(model_config(path)) == TINY_PARAMETERS
    assert parameter_count(model_config(path), value_head=True) == TINY_CRITIC_PARAMETERS
    config = LlamaConfig(**TINY, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    loaded = load_value_model(model_config(str(tmp_path / "model")), seed=0)  # the critic as the run loads it
    assert sum(parameter.numel() for parameter in LlamaForCausalLM(config).parameters()) == TINY_PARAMETERS
    assert sum(parameter.numel() for parameter in loaded.parameters()) == TINY_CRITIC_PARAMETERS
    assert parameter_count(model_config(str(tmp_path / "absent"))) is None  # the model checks report it


def _estimates(path: str, *words: str) -> dict:
    cfg = load_config("grpo_tiny", [f"actor_rollout_ref.model.path={path}", "data.train_files=x.parquet", *words])
    estimates, missing = estimate_memory(cfg)
    assert not missing
    return {estimate.role: estimate for estimate in estimates}


def test_the_estimate_counts_every_copy(tmp_path):
    path, p, c = write_config(tmp_path / "m"), TINY_PARAMETERS, TINY_CRITIC_PARAMETERS
    colocated = _estimates(path)
    assert set(colocated) == {"actor"}  # the rollout samples with the actor's weights
    assert colocated["actor"].parts == {"weights": 4 * p, "gradients": 4 * p, "AdamW state": 8 * p}
    assert colocated["actor"].processes == 1 and not colocated["actor"].on_gpu
    every = _estimates(
        path,
        "actor_rollout_ref.hybrid_engine=false",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "critic.enable=true",
        "actor_rollout_ref.rollout.dtype=bfloat16",
    )
    assert {role: estimate.parts for role, estimate in every.items()} == {
        "actor": {"weights": 4 * p, "gradients": 4 * p, "AdamW state": 8 * p},
        "ref": {"weights": 4 * p},
        "rollout": {"weights": 2 * p},  # rollout.dtype=bfloat16
        "critic": {"weights": 4 * c, "gradients": 4 * c, "AdamW state": 8 * c},
    }
    half = _estimates(path, "actor_rollout_ref.model.dtype=bfloat16")["actor"]
    assert half.total == 16 * p // 2
    ranks = _estimates(path, "trainer.n_cpu_ranks_per_node=2", "actor_rollout_ref.hybrid_engine=false")
    shard = -(-p // 2)
    assert ranks["actor"].parts == {"weights": 4 * shard, "gradients": 4 * shard, "AdamW state": 8 * shard}
    assert ranks["actor"].processes == 2 and ranks["rollout"].processes == 1
    # every rank colocated: sampling, a rank holds the full weights in float32 where it held its gradients' shard
    sampling = _estimates(path, "trainer.n_cpu_ranks_per_node=4", "actor_rollout_ref.rollout.dtype=float32")
    quarter = -(-p // 4)
    assert set(sampling) == {"actor"} and sampling["actor"].processes == 4
    assert sampling["actor"].parts == {
        "weights": 4 * quarter,
        "gradients": 4 * quarter,
        "AdamW state": 8 * quarter,
        "sampling copy": 4 * p - 4 * quarter,
    }
    in_bfloat16 = _estimates(path, "trainer.n_cpu_ranks_per_node=2", "actor_rollout_ref.rollout.dtype=bfloat16")
    assert "sampling copy" not in in_bfloat16["actor"].parts  # 2p <= 2p
    kept = _estimates(
        path,
        "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
        "trainer.n_cpu_ranks_per_node=2",
        "actor_rollout_ref.hybrid_engine=false",
    )
    assert kept["actor"].parts["gathered weights"] == 4 * p  # FSDP2 keeps the whole model from forward to backward
    replicas = _estimates(
        path,
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.num_replicas=3",
        "actor_rollout_ref.rollout.dtype=bfloat16",
    )
    assert replicas["rollout"].parts == {"weights": 2 * p} and replicas["rollout"].processes == 3
    in_float32 = _estimates(path, "actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.dtype=float32")
    assert in_float32["rollout"].parts == {"weights": 4 * p}


def test_a_model_still_to_be_built_is_not_estimated(tmp_path):
    cfg = load_config("grpo_tiny", [f"actor_rollout_ref.model.path={tmp_path}/later", "data.train_files=x.parquet"])
    assert estimate_memory(cfg) == ([], ["actor"])
    assert "not estimated: actor" in memory_estimate.memory_note(cfg)


def test_a_layout_that_cannot_fit_is_refused_naming_the_keys(capsys, tmp_path, tiny_model, tiny_overrides):
    # ~1.1e12 parameters: 16 bytes each for the actor alone, far beyond any machine's RAM
    huge = write_config(
        tmp_path / "huge",
        vocab_size=32000,
        hidden_size=32768,
        intermediate_size=131072,
        num_hidden_layers=64,
        num_attention_heads=64,
    )
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        f"actor_rollout_ref.model.path={huge}",
        f"actor_rollout_ref.model.tokenizer_path={tiny_model}",
        "actor_rollout_ref.hybrid_engine=false",
    )
    assert_user_error(
        code,
        stderr,
        "  actor_rollout_ref.actor: the actor needs ",
        "(weights ",
        "in RAM, of the ",
        "available",
        "change actor_rollout_ref.model.dtype, actor_rollout_ref.model.lora_rank",
        "  actor_rollout_ref.rollout: the rollout needs ",
        "change actor_rollout_ref.rollout.dtype, actor_rollout_ref.hybrid_engine",
    )


def test_a_run_that_fits_passes_and_says_what_it_needs(tiny_model, tiny_overrides):
    cfg = load_config("grpo_tiny", tiny_overrides)
    assert memory_estimate.memory_problems(cfg) == []
    note = memory_estimate.memory_note(cfg)
    assert note.startswith("memory estimate (weights, gradients, AdamW state): actor ") and " in RAM" in note


def test_a_gpu_role_beyond_its_share_of_the_gpu_is_refused(tmp_path, monkeypatch):
    """The GPU check on a CPU machine: the budget as a GPU machine would report it (the rules that keep GPU
    layouts off a CPU machine are the config's, not this check's)."""
    path = write_config(tmp_path / "m")
    cfg = load_config("grpo_tiny", [f"actor_rollout_ref.model.path={path}", "data.train_files=x.parquet"])
    gpu_cfg = cfg.model_copy(
        update={
            "actor_rollout_ref": cfg.actor_rollout_ref.model_copy(
                update={
                    "actor": cfg.actor_rollout_ref.actor.model_copy(
                        update={"resources": cfg.actor_rollout_ref.actor.resources.model_copy(update={"num_gpus": 0.5})}
                    )
                }
            )
        }
    )
    actor_bytes = 16 * TINY_PARAMETERS
    monkeypatch.setattr(
        memory_estimate, "local_budget", lambda cfg, needs_gpu: memory_estimate.Budget(None, actor_bytes)
    )
    ((key, message),) = memory_estimate.memory_problems(gpu_cfg)  # half of a GPU that holds the actor's state exactly
    assert key == "actor_rollout_ref.actor" and "on GPU" in message and "(0.5 of " in message
    assert "actor_rollout_ref.actor.fsdp_config.offload_policy, trainer.n_gpus_per_node" in message
    monkeypatch.setattr(
        memory_estimate, "local_budget", lambda cfg, needs_gpu: memory_estimate.Budget(None, 4 * actor_bytes)
    )
    assert memory_estimate.memory_problems(gpu_cfg) == []


def test_a_cluster_elsewhere_is_not_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cfg = load_config("grpo_tiny", ["actor_rollout_ref.model.path=x", "data.train_files=x.parquet"])
    assert memory_estimate.local_budget(cfg, needs_gpu=True) == memory_estimate.Budget(None, None)
