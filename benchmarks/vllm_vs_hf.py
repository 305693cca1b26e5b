"""Generation throughput of the vLLM rollout engine against the transformers one (same model, prompts and
sampling, one GPU), and the time each takes in the full state dict from ``ActorWorker.prepare_weights``.

Without ``--model`` a random-init Llama of ``--size`` with the demo's tokenizer (random EOS, so both engines see one
length distribution); ``--model`` takes any local Hugging Face causal LM. Throughput counts valid response tokens
per second of ``generate`` after a warm-up. Needs a CUDA GPU and ``ppoflow[vllm]``. Details: docs/benchmarks.md#vllm.

    python benchmarks/vllm_vs_hf.py [--size 100M | --model PATH] [--dtype bfloat16] [--prompts 128] [--n 4]
                                    [--max-new-tokens 256] [--repeats 3] [--gpu-memory-utilization 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SIZES = {  # Llama shapes built from config (hidden, intermediate, layers, heads); heads are 64 wide
    "tiny": (128, 256, 2, 2),
    "100M": (1024, 2816, 8, 16),
    "450M": (1536, 4096, 16, 24),
}


def prompt_batch(tokenizer, count: int, seed: int):
    """``count`` left-padded prompts like the demo's (``"37+5="``), as the rollout's prompt TensorDict."""
    import torch
    from tensordict import TensorDict

    rng = random.Random(seed)
    ids = [
        tokenizer(f"{rng.randrange(1000)}+{rng.randrange(1000)}=", add_special_tokens=False)["input_ids"]
        for _ in range(count)
    ]
    width = max(len(row) for row in ids)
    prompts = torch.full((count, width), tokenizer.pad_token_id, dtype=torch.int64)
    mask = torch.zeros((count, width), dtype=torch.bool)
    for row, tokens in enumerate(ids):
        prompts[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = True
    return TensorDict({"prompts": prompts, "prompt_mask": mask}, batch_size=[count]), width


def throughput(engine, prompts, sampling, repeats: int) -> dict:
    """Median valid-tokens/s of ``generate`` over ``repeats`` steps (after a warm-up step)."""
    import torch

    engine.generate(prompts, step=0, sampling=sampling)
    rates, lengths = [], []
    for step in range(1, repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        batch = engine.generate(prompts, step=step, sampling=sampling)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = int(batch["response_mask"].sum())
        rates.append(tokens / seconds)
        lengths.append(tokens / batch.batch_size[0])
    return {"tokens_per_s": statistics.median(rates), "mean_response_tokens": statistics.mean(lengths)}


def update_time(engine, update, repeats: int) -> float:
    """Median seconds of ``apply_weights`` for the full state dict."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.apply_weights(update)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="100M")
    parser.add_argument("--model", help="a local Hugging Face causal LM directory instead of a built one")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (>= 2, GRPO)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()

    import torch

    from ppoflow.configs import load_config
    from ppoflow.configs.rules_vllm import installed_vllm_version
    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.workers.models import build_tiny_model, load_tokenizer
    from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
    from ppoflow.workers.rollout.sampling import SamplingParams
    from ppoflow.workers.rollout.vllm_worker import VLLMRolloutWorker
    from ppoflow.workers.training.policy import ActorWorker

    if not torch.cuda.is_available() or installed_vllm_version() is None:
        sys.exit("needs a CUDA GPU and vllm (pip install 'ppoflow[vllm]')")
    if args.n < 2:
        sys.exit("--n must be at least 2 (the GRPO preset's group size)")
    with tempfile.TemporaryDirectory() as scratch:
        path, name = args.model, args.model
        if path is None:
            hidden, intermediate, layers, heads = SIZES[args.size]
            path, name = f"{scratch}/model", f"random Llama {args.size}"
            build_tiny_model(
                path,
                TinyModelConfig(
                    hidden_size=hidden,
                    intermediate_size=intermediate,
                    num_hidden_layers=layers,
                    num_attention_heads=heads,
                    max_position_embeddings=args.max_new_tokens + 64,
                    seed=0,
                ),
            )
        base = [
            f"actor_rollout_ref.model.path={path}",
            "actor_rollout_ref.model.build=null",
            f"actor_rollout_ref.model.dtype={args.dtype}",
            f"data.train_files={scratch}/unused.parquet",
            "data.val_files=null",
            "trainer.test_freq=-1",
            "trainer.logger=[]",
            f"data.max_response_length={args.max_new_tokens}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.rollout.temperature={args.temperature}",
            f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.resources.num_gpus=1",
            "rollout.n_gpus_per_node=1",
            "actor_rollout_ref.actor.resources.num_gpus=1",
            "trainer.n_gpus_per_node=1",
        ]
        tokenizer = load_tokenizer(
            load_config("grpo_tiny", [f"actor_rollout_ref.model.path={path}"]).actor_rollout_ref.model
        )
        prompts, prompt_width = prompt_batch(tokenizer, args.prompts, seed=0)
        cfg = load_config("grpo_tiny", base + [f"data.max_prompt_length={prompt_width}"])
        sampling = SamplingParams.for_training(cfg)

        start = time.perf_counter()
        vllm_engine = VLLMRolloutWorker(cfg)  # first, so its memory profiling sees the GPU to itself
        vllm_start = time.perf_counter() - start
        start = time.perf_counter()
        hf_engine = HFRolloutWorker(cfg)
        hf_start = time.perf_counter() - start
        results = {
            "vllm": throughput(vllm_engine, prompts, sampling, args.repeats),
            "hf": throughput(hf_engine, prompts, sampling, args.repeats),
        }

        actor = ActorWorker(cfg)
        start = time.perf_counter()
        update = actor.prepare_weights()
        prepare = time.perf_counter() - start
        mib = update.nbytes / 2**20
        results["vllm"]["update_s"] = update_time(vllm_engine, update, args.repeats)
        results["hf"]["update_s"] = update_time(hf_engine, update, args.repeats)
        results["vllm"]["startup_s"], results["hf"]["startup_s"] = vllm_start, hf_start
        vllm_engine.shutdown()

    print(
        f"{name}, {args.dtype}, {torch.cuda.get_device_name(0)}, vllm {installed_vllm_version()}, "
        f"torch {torch.__version__}; {args.prompts} prompts x n={args.n}, up to {args.max_new_tokens} new tokens, "
        f"temperature {args.temperature}; median of {args.repeats}"
    )
    print(f"weights: {mib:.1f} MiB in {len(update.layouts)} bucket(s); prepare_weights {prepare * 1000:.0f} ms")
    print("| engine | startup s | tokens/s | mean response tokens | full weight update ms | update GB/s |")
    print("|---|---|---|---|---|---|")
    for engine, row in results.items():
        print(
            f"| {engine} | {row['startup_s']:.1f} | {row['tokens_per_s']:.0f} | {row['mean_response_tokens']:.1f} | "
            f"{row['update_s'] * 1000:.0f} | {update.nbytes / row['update_s'] / 1e9:.2f} |"
        )
    speedup = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    print(f"vLLM generates {speedup:.1f}x the transformers engine's tokens/s")
    print(
        json.dumps(
            {
                "model": name,
                "dtype": args.dtype,
                "prompts": args.prompts,
                "n": args.n,
                "max_new_tokens": args.max_new_tokens,
                "weights_mib": round(mib, 1),
                "prepare_weights_s": prepare,
                **{f"{e}_{k}": v for e, row in results.items() for k, v in row.items()},
                "speedup": speedup,
            }
        )
    )


if __name__ == "__main__":
    main()
