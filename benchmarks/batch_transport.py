"""What it costs a step batch to cross between the driver and a Ray worker, as plain values or pickled
as a TensorDict.

Echoes the same batch through one Ray actor (driver -> worker -> driver) three ways, alternating in rounds: plain
values (:mod:`ppoflow.workers.transport`), the TensorDict pickled as it is (Ray's default, the baseline) and
``TensorDict.consolidate()``; on the demo's batch and a larger one (64 prompts x 16 samples, 256 + 512 tokens).
Method and figures: docs/benchmarks.md#a-batchs-trip-to-a-worker-and-back.

    python benchmarks/batch_transport.py [--rounds 4] [--trips 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from tensordict import TensorDict
from workloads import start_local_ray  # noqa: E402 (benchmarks/ is the script's folder)


def step_batch(prompts: int, samples: int, prompt_tokens: int, response_tokens: int) -> TensorDict:
    """A batch as the update receives it: the rollout's fields, rewards, advantages and returns."""
    from ppoflow.storage.batch import with_non_tensor_columns

    rows, generator = prompts * samples, torch.Generator().manual_seed(0)
    response = (rows, response_tokens)
    batch = TensorDict(
        {
            "prompts": torch.randint(0, 32000, (rows, prompt_tokens), generator=generator),
            "prompt_mask": torch.ones(rows, prompt_tokens, dtype=torch.bool),
            "responses": torch.randint(0, 32000, response, generator=generator),
            "response_mask": torch.ones(response, dtype=torch.bool),
            "rollout_log_probs": torch.randn(response, generator=generator),
            "weight_version": torch.zeros(rows, dtype=torch.int64),
            "group_index": torch.arange(rows).div(samples, rounding_mode="floor"),
            **{
                name: torch.randn(response, generator=generator)
                for name in ("token_level_scores", "token_level_rewards", "advantages", "returns")
            },
        },
        batch_size=[rows],
    )
    uids = [f"prompt-{row // samples}" for row in range(rows)]
    return with_non_tensor_columns(
        batch,
        {"uid": uids, "data_source": ["copy"] * rows, "ground_truth": [[row // samples, 7, 3] for row in range(rows)]},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trips", type=int, default=25)
    args = parser.parse_args()

    import ray

    from ppoflow.workers.transport import send_batches_as_plain_values

    @ray.remote(num_cpus=1)
    class Echo:
        def sending_plain_values(self, plain: bool) -> None:
            send_batches_as_plain_values() if plain else ray.util.deregister_serializer(TensorDict)

        def echo(self, batch: TensorDict, consolidate: bool = False) -> TensorDict:
            return batch.consolidate() if consolidate and not batch.is_consolidated() else batch

    start_local_ray()
    worker = Echo.remote()
    batches = {"demo (128 x 8+3)": step_batch(16, 8, 8, 3), "larger (1024 x 256+512)": step_batch(64, 16, 256, 512)}
    ways = ("pickled", "consolidated", "plain")
    times: dict[tuple[str, str], list[float]] = {(name, way): [] for name in batches for way in ways}
    calls: list[float] = []  # the same round trip carrying no batch: Ray's own cost of a call
    for _ in range(args.rounds):
        for way in ways:
            ray.get(worker.sending_plain_values.remote(way == "plain"))
            send_batches_as_plain_values() if way == "plain" else ray.util.deregister_serializer(TensorDict)
            for name, batch in batches.items():
                consolidate = way == "consolidated"
                ray.get(worker.echo.remote(batch))  # warm-up
                for _ in range(args.trips):
                    start = time.perf_counter()
                    ray.get(worker.echo.remote(batch.consolidate() if consolidate else batch, consolidate))
                    times[name, way].append(time.perf_counter() - start)
        for _ in range(args.trips):
            start = time.perf_counter()
            ray.get(worker.echo.remote(None))
            calls.append(time.perf_counter() - start)
    ray.shutdown()

    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; median round trip (driver -> "
        f"worker -> driver) over {args.rounds} x {args.trips} trips, alternating; ms"
    )
    print(
        "| batch | pickled TensorDict | consolidated | plain values | consolidated / pickled | plain / pickled |\n"
        "|---|---|---|---|---|---|"
    )
    for name in batches:
        pickled, consolidated, plain = (statistics.median(times[name, way]) * 1000 for way in ways)
        print(
            f"| {name} | {pickled:.2f} | {consolidated:.2f} | {plain:.2f} | {consolidated / pickled:.2f} | "
            f"{plain / pickled:.2f} |"
        )
    print(f"| none (Ray's call alone) | {statistics.median(calls) * 1000:.2f} | | | | |")


if __name__ == "__main__":
    main()
