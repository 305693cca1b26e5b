"""How long ``weight_sync`` takes to move the actor's weights into the rollout worker (two Ray actors),
against the baseline of a plain in-memory copy of the same state dict inside one process.

Backends: ``object_store`` (bucketed, through Ray's shared memory), ``object_store`` with ``delta``
(after an update that changed every tensor, and after one that changed a single layer), and
``gloo`` (the collective code path NCCL uses on GPUs).

    python benchmarks/weight_sync.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

MODELS = {  # Llama shapes built from config: (hidden, intermediate, layers, heads)
    "tiny (332k params)": (128, 256, 2, 4),
    "10.5M params": (512, 1024, 4, 8),
    "103M params": (1024, 2816, 8, 16),
}


def in_memory_copy(model, repeats: int) -> float:
    """The baseline: copy a state dict into a second model in the same process."""
    import copy

    target = copy.deepcopy(model)
    times = []
    for _ in range(repeats):
        state = model.state_dict()
        start = time.perf_counter()
        target.load_state_dict(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def perturb(actor, change: str) -> None:
    """Runs inside the actor worker: change every tensor, or one layer, as an update would."""
    import torch

    with torch.no_grad():
        tensors = list(actor.model.parameters())
        for tensor in tensors if change == "all" else tensors[-2:-1]:
            tensor.add_(1e-3)


def ray_sync(cfg, repeats: int, change: str) -> float:
    """Median wall time of the weight_sync stage between the run's actor and rollout Ray actors."""
    import ray

    from ppoflow.tasks.weight_sync import weight_sync
    from ppoflow.workers.launcher import start_workers

    workers = start_workers(cfg)
    collective = cfg.actor_rollout_ref.rollout.weight_sync.backend != "object_store"
    try:
        weight_sync.fn(workers, collective)  # warm-up (and, with delta, the first full send)
        times = []
        for _ in range(repeats):
            ray.get(workers.actor.handle.__ray_call__.remote(perturb, change))
            start = time.perf_counter()
            weight_sync.fn(workers, collective)
            times.append(time.perf_counter() - start)
    finally:
        for handle in workers._handles:
            ray.kill(handle)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import ray

    from ppoflow.configs import load_config
    from ppoflow.workers.models import build_tiny_model, load_causal_lm

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, (hidden, intermediate, layers, heads) in MODELS.items():
            base = [
                "data.val_files=null",
                f"actor_rollout_ref.model.path={scratch}/{hidden}",
                f"data.train_files={scratch}/train.parquet",
                f"actor_rollout_ref.model.build.hidden_size={hidden}",
                f"actor_rollout_ref.model.build.intermediate_size={intermediate}",
                f"actor_rollout_ref.model.build.num_hidden_layers={layers}",
                f"actor_rollout_ref.model.build.num_attention_heads={heads}",
                "trainer.test_freq=-1",
            ]
            cfg = load_config("grpo_tiny", base)
            build_tiny_model(cfg.actor_rollout_ref.model.path, cfg.actor_rollout_ref.model.build)
            model = load_causal_lm(cfg.actor_rollout_ref.model)
            mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
            baseline = in_memory_copy(model, args.repeats)
            variants = {
                "object_store": ([], "all"),
                "object_store, delta, all changed": (["delta=true"], "all"),
                "object_store, delta, one layer changed": (["delta=true"], "one"),
                "gloo collective": (["backend=gloo"], "all"),
            }
            for variant, (sync_overrides, change) in variants.items():
                sync_cfg = load_config(
                    "grpo_tiny", base + [f"actor_rollout_ref.rollout.weight_sync.{o}" for o in sync_overrides]
                )
                seconds = ray_sync(sync_cfg, args.repeats, change)
                rows.append(
                    {
                        "model": name,
                        "MiB": round(mib, 1),
                        "sync": variant,
                        "ms": round(seconds * 1000, 1),
                        "in_memory_copy_ms": round(baseline * 1000, 1),
                        "x_copy": round(seconds / baseline, 2),
                    }
                )
    ray.shutdown()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; median of {args.repeats}")
    print("| model | MiB | weight_sync | ms | in-memory copy ms | x copy |\n|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['MiB']} | {row['sync']} | {row['ms']} | {row['in_memory_copy_ms']} "
            f"| {row['x_copy']} |"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
