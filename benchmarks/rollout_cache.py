"""What the step cache saves and what it costs.

1. Replay vs generation: the training flow (Prefect + Ray, as ``ppoflow train`` runs it) trains the
   same steps twice with ``skip.rollout`` in ``cache`` mode: the first run generates and dumps, the
   second replays every step. Reported: median ``timing_s/gen`` and ``timing_s/step`` of each run.
2. Load throughput: one large step batch is written once; ``StepCache.load`` (read + sha256 +
   decode) is timed against a raw read of the same payload bytes, on a local folder and on S3
   (moto's server on 127.0.0.1, started here).

    python benchmarks/rollout_cache.py [--steps 10] [--mib 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import tempfile
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import WORKLOADS, built_in  # noqa: E402 (benchmarks/ is the script's folder)


def replay_vs_generation(scratch: str, steps: int) -> dict:
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    results = {}
    for name, workload in WORKLOADS.items():
        base = (
            workload
            + built_in(scratch, name)
            + [
                "trainer.test_freq=-1",
                "trainer.logger=[]",
                f"trainer.total_training_steps={steps}",
                "skip.rollout.enable=true",
                f"skip.rollout.dump_dir={scratch}/{name}-dump",
                f"skip.rollout.steps={list(range(1, steps + 1))}",
            ]
        )
        for run in ("generate", "replay"):
            run_dir = f"{scratch}/{name}-{run}"
            ppo_train(config="grpo_tiny", overrides=base + [f"trainer.default_local_dir={run_dir}"])
            rows = read_metrics(run_dir)[1:]  # the first step also pays worker warm-up
            if run == "generate":
                results[f"{name}/record"] = record_sizes(f"{scratch}/{name}-dump")
            results[f"{name}/{run}"] = {
                key: round(statistics.median(row[f"timing_s/{key}"] for row in rows) * 1000, 1)
                for key in ("gen", "step")
            }
            results[f"{name}/{run}"]["hits"] = sum(row["skip/rollout/hit"] for row in rows)
    return results


def record_sizes(dump_dir: str) -> dict:
    """Bytes of step 1's payload and of the marker Prefect persists (its own metadata is derived from the
    marker, not stored) - and what Prefect's default record (one JSON with the base64 of a cloudpickle)
    of the same batch would weigh."""
    import base64
    from pathlib import Path

    import cloudpickle

    from ppoflow.storage.step_cache import StepCache

    step_dir = next(Path(dump_dir).glob("*/*/1"))
    batch, _ = StepCache(str(step_dir.parent)).load(1)
    return {
        "payload_bytes": (step_dir / "rollout.safetensors").stat().st_size,
        "marker_bytes": (step_dir / "meta.json").stat().st_size,
        "default_prefect_record_bytes": len(base64.b64encode(cloudpickle.dumps(batch))),
    }


def load_throughput(scratch: str, mib: int, storage_options: dict | None, root: str) -> dict:
    import torch
    from tensordict import TensorDict

    from ppoflow.storage.batch import with_non_tensor_columns
    from ppoflow.storage.fs import open_fs
    from ppoflow.storage.step_cache import StepCache

    rows, width = 1024, max(16, mib * 2**20 // (1024 * 21))  # 21 bytes per position: 2 int64 ids, a bool, a float32
    batch = TensorDict(
        {
            "prompts": torch.randint(0, 32000, (rows, width)),
            "responses": torch.randint(0, 32000, (rows, width)),
            "response_mask": torch.ones(rows, width, dtype=torch.bool),
            "rollout_log_probs": torch.randn(rows, width),
        },
        batch_size=[rows],
    )
    with_non_tensor_columns(batch, {"uid": [str(i // 8) for i in range(rows)]})
    cache = StepCache(root, storage_options=storage_options)
    manifest = cache.write(1, batch)
    fs, payload_path = open_fs(cache.payload_url(1), storage_options)
    raw, loaded = [], []
    for _ in range(5):
        start = time.perf_counter()
        fs.cat_file(payload_path)
        raw.append(time.perf_counter() - start)
        start = time.perf_counter()
        cache.load(1)
        loaded.append(time.perf_counter() - start)
    size_mib = manifest["payload_bytes"] / 2**20
    raw_s, load_s = statistics.median(raw), statistics.median(loaded)
    return {
        "payload_mib": round(size_mib, 1),
        "raw_read_mib_s": round(size_mib / raw_s, 1),
        "load_mib_s": round(size_mib / load_s, 1),
        "load_time_x_raw": round(load_s / raw_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()

    import boto3
    import ray
    from moto.server import ThreadedMotoServer

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    )
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
    s3_options = {"client_kwargs": {"endpoint_url": endpoint}}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            replay = replay_vs_generation(scratch, args.steps)
            throughput = {
                "local": load_throughput(scratch, args.mib, None, f"{scratch}/load"),
                "s3 (moto on 127.0.0.1)": load_throughput(scratch, args.mib, s3_options, "s3://bench/load"),
            }
    finally:
        server.stop()
        ray.shutdown()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print("| workload | run | timing_s/gen ms | timing_s/step ms | cache hits |\n|---|---|---|---|---|")
    for key, row in replay.items():
        workload, run = key.split("/")
        if run != "record":
            print(f"| {workload} | {run} | {row['gen']} | {row['step']} | {row['hits']} |")
    print(
        "| workload | payload bytes | meta.json (Prefect's record) | Prefect's default record would be |"
        "\n|---|---|---|---|"
    )
    for key, row in replay.items():
        workload, run = key.split("/")
        if run == "record":
            print(
                f"| {workload} | {row['payload_bytes']} | {row['marker_bytes']} | "
                f"{row['default_prefect_record_bytes']} |"
            )
    print(
        "| storage | payload MiB | raw read MiB/s | StepCache.load MiB/s | load time / raw read |\n"
        "|---|---|---|---|---|"
    )
    for storage, row in throughput.items():
        print(
            f"| {storage} | {row['payload_mib']} | {row['raw_read_mib_s']} | {row['load_mib_s']} "
            f"| {row['load_time_x_raw']} |"
        )
    print(json.dumps({"replay": replay, "load": throughput}))


if __name__ == "__main__":
    main()
