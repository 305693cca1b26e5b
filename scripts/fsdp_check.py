"""The training engine's GPU check: FSDP2 with bf16 mixed precision against float32, and update throughput.

Runs ppoflow's actor worker in this process (no Ray, no Prefect) as rank 0 of a one-rank process group (NCCL on
CUDA; gloo on a CPU), sharded with ``fully_shard`` as a Ray rank shards it, and compares float32 with bf16 from the
same weights and batch: log-probs, one update's loss and entropy, then ``--updates`` timed updates. Prints one JSON
line; exits 1 past the tolerances. Needs ``pip install --no-deps -e .`` plus pydantic, omegaconf, tensordict, fsspec
and safetensors. Details: docs/scale_out.md#on-a-gpu.

    python scripts/fsdp_check.py                   # on a GPU machine (about a minute on an H200)
    python scripts/fsdp_check.py --smoke           # a tiny CPU run of the same code
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
from tensordict import TensorDict

from ppoflow.configs import load_config
from ppoflow.configs.schema import TinyModelConfig
from ppoflow.workers.models import build_tiny_model
from ppoflow.workers.training.data_parallel import RankInfo
from ppoflow.workers.training.policy import ActorWorker

TOLERANCE = {"log_prob_mean_abs": 0.05, "pg_loss_rel": 0.02, "entropy_rel": 0.02}
"""bf16 keeps 8 bits of mantissa: per-token log-probs move by a few hundredths, batch means far less."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU run)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="trajectories per update")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=448)
    parser.add_argument("--micro", type=int, default=16, help="ppo_micro_batch_size_per_gpu")
    parser.add_argument("--updates", type=int, default=5, help="timed updates per precision")
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.batch, args.prompt, args.response, args.micro, args.updates = (
            64,
            2,
            8,
            8,
            24,
            4,
            2,
        )
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as root:
        model_dir = os.path.join(root, "model")
        build_tiny_model(
            model_dir,
            TinyModelConfig(
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=args.hidden // 64,
                max_position_embeddings=args.prompt + args.response,
                seed=0,
            ),
        )
        batch = _batch(args, vocab=32)
        full = _run(args, model_dir, batch, "float32", cuda, old_log_probs=None)
        mixed = _run(args, model_dir, batch, "bfloat16", cuda, old_log_probs=full["old_log_probs"])
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "model": f"Llama hidden={args.hidden} layers={args.layers}",
        "batch": args.batch,
        "tokens_per_update": full["tokens"],
        "log_prob_mean_abs_diff": (mixed["log_probs"] - full["log_probs"]).abs()[batch["response_mask"]].mean().item(),
        "pg_loss": [full["pg_loss"], mixed["pg_loss"]],
        "entropy": [full["entropy"], mixed["entropy"]],
        "update_tokens_per_s": {"float32": full["tokens_per_s"], "bfloat16": mixed["tokens_per_s"]},
        "bf16_speedup": mixed["tokens_per_s"] / full["tokens_per_s"],
        "tolerance": TOLERANCE,
    }
    within = (
        report["log_prob_mean_abs_diff"] <= TOLERANCE["log_prob_mean_abs"]
        and _rel(mixed["pg_loss"], full["pg_loss"]) <= TOLERANCE["pg_loss_rel"]
        and _rel(mixed["entropy"], full["entropy"]) <= TOLERANCE["entropy_rel"]
    )
    report["result"] = "PASS" if within else "FAIL"
    print(json.dumps(report))
    return 0 if within else 1


def _rel(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-8)


def _batch(args, vocab: int) -> TensorDict:
    """Random prompts (left-padded) and responses (right-padded, lengths spread), fixed advantages."""
    generator = torch.Generator().manual_seed(0)
    rows = args.batch
    prompt_lengths = torch.randint(args.prompt // 2, args.prompt + 1, (rows,), generator=generator)
    response_lengths = torch.randint(args.response // 4, args.response + 1, (rows,), generator=generator)
    prompt_mask = torch.arange(args.prompt).flip(0).unsqueeze(0) < prompt_lengths.unsqueeze(1)
    response_mask = torch.arange(args.response).unsqueeze(0) < response_lengths.unsqueeze(1)
    prompts = torch.randint(4, vocab, (rows, args.prompt), generator=generator) * prompt_mask
    responses = torch.randint(4, vocab, (rows, args.response), generator=generator) * response_mask
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, args.response) * response_mask
    return TensorDict(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "advantages": advantages.contiguous(),
        },
        batch_size=[rows],
    )


def _run(args, model_dir: str, batch: TensorDict, precision: str, cuda: bool, old_log_probs) -> dict:
    """One fresh worker at ``precision``: log-probs, the first update's metrics, then timed updates. The old
    log-probs of the update are float32's (``old_log_probs``; None: this run's own, a little lowered, so the
    ratio sits inside the clip and the loss depends on the precision)."""
    param_dtype = "null" if precision == "float32" else precision
    cfg = load_config(
        "grpo_tiny",
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "data.train_files=unused.parquet",
            "data.val_files=null",
            f"data.max_prompt_length={args.prompt}",
            f"data.max_response_length={args.response}",
            f"data.train_batch_size={args.batch}",
            "actor_rollout_ref.rollout.n=1",
            "algorithm.adv_estimator=reinforce_plus_plus",
            "trainer.test_freq=-1",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.entropy_coeff=0.001",
            f"actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={param_dtype}",
            f"trainer.n_gpus_per_node={1 if cuda else 0}",
            f"actor_rollout_ref.actor.resources.num_gpus={1 if cuda else 0}",
            "actor_rollout_ref.hybrid_engine=false",
        ],
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    actor = ActorWorker(cfg, ranks=RankInfo(0, 1, "127.0.0.1", port))
    try:
        log_probs = actor.compute_log_prob(batch)["log_probs"]
        trainable = batch.copy()
        if old_log_probs is None:
            old_log_probs = log_probs - 0.05 * batch["response_mask"]
        trainable["old_log_probs"] = old_log_probs
        first = actor.update(trainable, step=1).metrics
        timings = []
        for step in range(args.updates):
            _synchronize(cuda)
            started = time.perf_counter()
            actor.update(trainable, step=2 + step)
            _synchronize(cuda)
            timings.append(time.perf_counter() - started)
        tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
        return {
            "log_probs": log_probs,
            "old_log_probs": old_log_probs,
            "pg_loss": first["actor/pg_loss"],
            "entropy": first["actor/entropy"],
            "tokens": tokens,
            "tokens_per_s": tokens / sorted(timings)[len(timings) // 2],
        }
    finally:
        dist.destroy_process_group()


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(main())
