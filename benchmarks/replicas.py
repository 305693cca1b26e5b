"""Rollout replicas: generation throughput of 1 and 2 replicas behind the load balancer, trainer idle.

Sends the long-tailed request set of ``benchmarks/continuous_batching.py`` through the :class:`LoadBalancer` to 1
and then 2 ``RolloutReplica`` actors (one CPU and one thread each), all requests at once, and reports useful
tokens/s (median of ``--repeats``), the ratio to one replica and the load. On 2 cores the ceiling is 2x.
Figures: docs/benchmarks.md#rollout-replicas.

    python benchmarks/replicas.py [--requests 64] [--max-num-seqs 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from continuous_batching import long_tailed_budgets  # noqa: E402 (benchmarks/ is the script's folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import ray

    from ppoflow.configs import load_config
    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.workers.models import TINY_CHARACTERS, TINY_SPECIAL_TOKENS, build_tiny_model
    from ppoflow.workers.rollout.requests import RequestSampling
    from ppoflow.workers.service.replicas import LoadBalancer, RolloutReplica

    draw = random.Random(args.seed)
    budgets = long_tailed_budgets(args.requests, args.seed)
    characters = range(len(TINY_SPECIAL_TOKENS), len(TINY_SPECIAL_TOKENS) + len(TINY_CHARACTERS))
    prompts = [[draw.choice(characters) for _ in range(draw.randint(8, 16))] for _ in range(args.requests)]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results: dict[int, float] = {}
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
        cfg = load_config(
            "grpo_tiny",
            [
                f"actor_rollout_ref.model.path={scratch}",
                "actor_rollout_ref.rollout.mode=async",
                f"actor_rollout_ref.rollout.max_num_seqs={args.max_num_seqs}",
            ],
        )
        for count in (1, 2):
            replicas = [
                ray.remote(RolloutReplica)
                .options(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
                .remote(cfg)
                for _ in range(count)
            ]
            ray.get([replica.__ray_ready__.remote() for replica in replicas])
            balancer = LoadBalancer(replicas)

            async def serve_all(round_: int, balancer: LoadBalancer = balancer) -> None:
                await asyncio.gather(
                    *(
                        balancer.generate(
                            f"r{round_}/{i}",
                            prompt,
                            RequestSampling(
                                temperature=1.0,
                                top_p=1.0,
                                top_k=-1,
                                greedy=False,
                                max_new_tokens=budget,
                                seed=i,
                                ignore_eos=True,
                            ),
                        )
                        for i, (prompt, budget) in enumerate(zip(prompts, budgets))
                    )
                )

            asyncio.run(serve_all(-1))  # warm-up
            rates = []
            for round_ in range(args.repeats):
                started = time.perf_counter()
                asyncio.run(serve_all(round_))
                rates.append(sum(budgets) / (time.perf_counter() - started))
            results[count] = statistics.median(rates)
            for replica in replicas:
                ray.kill(replica)
    ray.shutdown()
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.requests} requests, budgets "
        f"{min(budgets)}-{max(budgets)} ({sum(budgets)} tokens), max_num_seqs {args.max_num_seqs}; "
        f"median of {args.repeats}"
    )
    print("| replicas | tokens/s | x 1 replica |\n|---|---|---|")
    for count, rate in results.items():
        print(f"| {count} | {rate:.0f} | {rate / results[1]:.2f} |")
    print(json.dumps({str(count): rate for count, rate in results.items()}))


if __name__ == "__main__":
    main()
