"""What Prefect and Ray cost per PPO step, measured against the same step run bare.

The same steps (same config, seed and prompts) run four ways in this process: ``bare`` (plain objects and
functions), ``ray`` (Ray actors, plain functions), ``prefect`` (in-process workers, Prefect task runs) and
``prefect + ray`` (what ``ppoflow train`` does). Reported per workload: the median step after a warm-up and the
ratio to bare. Figures: docs/benchmarks.md#orchestration-overhead.

    python benchmarks/orchestration_overhead.py [--steps 30] [--workload demo|larger|all]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import WORKLOADS, built_in, ppoflow_steps, timing_medians  # noqa: E402 (benchmarks/ is the script's folder)


def measure(cfg, *, ray_workers: bool, prefect_tasks: bool, steps: int, warmup: int) -> float:
    """Median ``timing_s/step`` over ``steps`` steps after ``warmup`` untimed ones."""
    rows = ppoflow_steps(cfg, ray_workers=ray_workers, prefect_tasks=prefect_tasks, steps=warmup + steps)
    return timing_medians(rows[warmup:])["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    args = parser.parse_args()

    import logging

    import ray

    from ppoflow.configs import load_config

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in WORKLOADS if args.workload == "all" else [args.workload]:
            overrides = (
                WORKLOADS[name]
                + built_in(scratch, name, validation=True)
                + [f"trainer.default_local_dir={scratch}/{name}-run"]
            )
            cfg = load_config("grpo_tiny", overrides)
            modes = {
                "bare": (False, False),
                "ray": (True, False),
                "prefect": (False, True),
                "prefect+ray": (True, True),
            }
            times = {
                mode: measure(cfg, ray_workers=r, prefect_tasks=p, steps=args.steps, warmup=args.warmup)
                for mode, (r, p) in modes.items()
            }
            results[name] = {
                mode: {
                    "ms_per_step": round(seconds * 1000, 1),
                    "ratio_to_bare": round(seconds / times["bare"], 2),
                    "overhead_ms": round((seconds - times["bare"]) * 1000, 1),
                }
                for mode, seconds in times.items()
            }
    ray.shutdown()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; median of {args.steps} steps")
    print("| workload | mode | ms/step | x bare | overhead ms/step |\n|---|---|---|---|---|")
    for name, modes in results.items():
        for mode, row in modes.items():
            print(f"| {name} | {mode} | {row['ms_per_step']} | {row['ratio_to_bare']} | {row['overhead_ms']} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
