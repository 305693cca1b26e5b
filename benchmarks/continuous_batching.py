"""Continuous batching (workers/rollout/serving.py) against static batching on a long-tailed batch of requests.

``--requests`` prompts (8-16 random tokens) on a random-init Llama (hidden 256, 4 layers), each with a seeded
long-tailed budget of 4-96 tokens, EOS ignored so both ways produce the same useful tokens (plain sampling, KV
cache on both). Static: ``model.generate`` on ``--batch-size`` batches, each run to its longest budget;
continuous: ``ContinuousBatchingEngine`` with ``max_num_seqs = --batch-size``. Reported: useful tokens/s (median of
``--repeats``, alternating), the ratio to static, sampling forwards and the share of useful slots.
Method and figures: docs/benchmarks.md#continuous-batching.

    python benchmarks/continuous_batching.py [--requests 64] [--batch-size 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

SHORTEST, LONGEST = 4, 96


def long_tailed_budgets(count: int, seed: int) -> list[int]:
    """``count`` response budgets in [SHORTEST, LONGEST]: log-normal around a short median, so a few
    requests are many times longer than most."""
    draw = random.Random(seed)
    return [min(LONGEST, max(SHORTEST, round(draw.lognormvariate(2.5, 0.9)))) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from ppoflow.configs.schema import ModelConfig, TinyModelConfig
    from ppoflow.workers.models import (
        TINY_CHARACTERS,
        TINY_SPECIAL_TOKENS,
        build_tiny_model,
        load_causal_lm,
        load_tokenizer,
    )
    from ppoflow.workers.rollout.requests import RequestSampling
    from ppoflow.workers.rollout.serving import ContinuousBatchingEngine

    draw = random.Random(args.seed)
    budgets = long_tailed_budgets(args.requests, args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        build_tiny_model(
            scratch,
            TinyModelConfig(
                hidden_size=256,
                intermediate_size=512,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=128,
                seed=0,
            ),
        )
        spec = ModelConfig(
            path=scratch,
            tokenizer_path=None,
            trust_remote_code=False,
            dtype="float32",
            enable_gradient_checkpointing=False,
            use_remove_padding=False,
            build=None,
            lora_rank=0,
            lora_alpha=16,
            target_modules="all-linear",
            lora_adapter_path=None,
        )
        tokenizer = load_tokenizer(spec)
        model = load_causal_lm(spec).eval()
    characters = range(len(TINY_SPECIAL_TOKENS), len(TINY_SPECIAL_TOKENS) + len(TINY_CHARACTERS))
    prompts = [[draw.choice(characters) for _ in range(draw.randint(8, 16))] for _ in range(args.requests)]
    useful = sum(budgets)

    def static() -> tuple[int, int]:
        """Useful tokens and sampling forwards of ``model.generate`` on batches in arrival order."""
        produced = forwards = 0
        for start in range(0, args.requests, args.batch_size):
            rows, row_budgets = prompts[start : start + args.batch_size], budgets[start : start + args.batch_size]
            width = max(len(prompt) for prompt in rows)
            input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in rows])
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
            longest = max(row_budgets)
            with torch.no_grad():
                sequences = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    pad_token_id=tokenizer.pad_token_id,
                )
            assert sequences.shape[1] - width == longest
            produced += sum(row_budgets)
            forwards += longest
        return produced, forwards

    def continuous() -> tuple[int, int]:
        """Useful tokens and sampling forwards of the engine serving every request."""
        engine = ContinuousBatchingEngine(
            model, eos_token_id=tokenizer.eos_token_id, device=torch.device("cpu"), max_num_seqs=args.batch_size
        )
        futures = [
            engine.submit(
                str(index),
                prompt,
                RequestSampling(
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    greedy=False,
                    max_new_tokens=budget,
                    seed=index,
                    ignore_eos=True,
                ),
            )
            for index, (prompt, budget) in enumerate(zip(prompts, budgets))
        ]
        while not all(future.done() for future in futures):
            engine.step()
        return sum(len(future.result().token_ids) for future in futures), engine.stats()["steps"]

    ways = {"static": static, "continuous": continuous}
    for run in ways.values():
        run()  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in ways}
    forwards: dict[str, int] = {}
    for _ in range(args.repeats):  # alternating, so that neither way gets a quieter moment of the machine
        for name, run in ways.items():
            torch.manual_seed(0)
            start = time.perf_counter()
            produced, forwards[name] = run()
            rates[name].append(produced / (time.perf_counter() - start))
            assert produced == useful
    median = {name: statistics.median(values) for name, values in rates.items()}

    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.requests} requests, budgets "
        f"{SHORTEST}-{LONGEST} (median {statistics.median(budgets):.0f}, longest {max(budgets)}, {useful} tokens), "
        f"batch size {args.batch_size}; median of {args.repeats}"
    )
    print("| way | tokens/s | x static | sampling forwards | useful slots |\n|---|---|---|---|---|")
    for name, rate in median.items():
        print(
            f"| {name} | {rate:.0f} | {rate / median['static']:.2f} | {forwards[name]} | "
            f"{useful / (forwards[name] * args.batch_size):.0%} |"
        )
    print(
        json.dumps(
            {
                name: {
                    "tokens_per_s": rate,
                    "ratio_to_static": rate / median["static"],
                    "sampling_forwards": forwards[name],
                }
                for name, rate in median.items()
            }
        )
    )


if __name__ == "__main__":
    main()
