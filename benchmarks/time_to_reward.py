"""Time to reward: how many steps, and how many seconds of training, the demo needs until its 10-step mean
reward reaches 0.9, for several seeds.

Each seed trains the demo as ``ppoflow train`` does (Prefect and Ray, sync mode, no validation) on a model
built with that seed; the seed also sets the data order and the sampling. The training seconds are the sum
of ``timing_s/step`` up to that step (start-up not included). Run it with two versions of ppoflow on the
same machine to compare them, or one version with ``--set key=value`` overrides (for instance
``--set actor_rollout_ref.rollout.mode=async``, the rollout service with ``single_turn_agent``):

    python benchmarks/time_to_reward.py [--seeds 0 1 2] [--steps 200] [--target 0.9] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

WINDOW = 10


def time_to_target(rows: list[dict], target: float) -> tuple[int | None, float | None]:
    """The first step whose trailing ``WINDOW``-step mean of ``critic/score/mean`` reaches ``target``, and the
    summed ``timing_s/step`` up to it; ``(None, None)`` if no step does."""
    seconds = 0.0
    for index, row in enumerate(rows):
        seconds += row["timing_s/step"]
        window = rows[max(0, index + 1 - WINDOW) : index + 1]
        if len(window) == WINDOW and sum(r["critic/score/mean"] for r in window) / WINDOW >= target:
            return row["step"], seconds
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    args = parser.parse_args()

    import ray

    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            run_dir = f"{scratch}/run{seed}"
            ppo_train(
                config="grpo_tiny",
                overrides=[
                    f"actor_rollout_ref.model.path={scratch}/model{seed}",
                    f"actor_rollout_ref.model.build.seed={seed}",
                    f"data.train_files={scratch}/train.parquet",
                    "data.synthetic.seed=0",
                    "data.val_files=null",
                    f"data.seed={seed}",
                    f"actor_rollout_ref.rollout.seed={seed}",
                    "trainer.test_freq=-1",
                    "trainer.logger=[]",
                    f"trainer.total_training_steps={args.steps}",
                    "trainer.save_freq=-1",
                    f"trainer.default_local_dir={run_dir}",
                    *args.set,
                ],
            )
            rows = read_metrics(run_dir)
            step, seconds = time_to_target(rows, args.target)
            results[seed] = {
                "step": step,
                "training_s": seconds,
                "final_10_step_mean": sum(r["critic/score/mean"] for r in rows[-WINDOW:]) / WINDOW,
                "median_step_s": sorted(r["timing_s/step"] for r in rows)[len(rows) // 2],
            }
    ray.shutdown()
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; target: {WINDOW}-step mean reward "
        f">= {args.target} within {args.steps} steps; overrides: {' '.join(args.set) or 'none'}"
    )
    print("| seed | step reached | training s to it | median step s | final 10-step mean |\n|---|---|---|---|---|")
    for seed, row in results.items():
        reached = "not reached" if row["step"] is None else row["step"]
        seconds = "-" if row["training_s"] is None else f"{row['training_s']:.1f}"
        print(f"| {seed} | {reached} | {seconds} | {row['median_step_s']:.3f} | {row['final_10_step_mean']:.3f} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
