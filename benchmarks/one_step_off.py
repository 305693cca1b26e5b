"""Does one-step-off pay? The same workload in ``sync`` and ``one_step_off`` mode, in one run.

The workload is balanced so that generation takes roughly as long as training (a 10.5M-parameter
Llama, 2 prompts x 8 samples, up to 48 response tokens); the rollout and the actor each get one
thread. Reported per mode: median ``timing_s/step``, generation time (``timing_s/gen`` in sync,
``timing_s/generate_async`` off-policy), training time (everything else in the step), and the
sync/one-step-off step-time ratio next to the ideal ``max(generation, training)``.

    python benchmarks/one_step_off.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import built_in  # noqa: E402 (benchmarks/ is the script's folder)

WORKLOAD = [
    "actor_rollout_ref.model.build.hidden_size=512",
    "actor_rollout_ref.model.build.intermediate_size=1024",
    "actor_rollout_ref.model.build.num_hidden_layers=4",
    "actor_rollout_ref.model.build.num_attention_heads=8",
    "data.max_response_length=48",
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.test_freq=-1",
    "trainer.logger=[]",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()

    import ray

    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for mode in ("sync", "one_step_off"):
            run_dir = f"{scratch}/{mode}"
            ppo_train(
                config="grpo_tiny",
                overrides=WORKLOAD
                + built_in(scratch, "larger")
                + [
                    f"trainer.mode={mode}",
                    f"trainer.total_training_steps={args.steps}",
                    f"trainer.default_local_dir={run_dir}",
                ],
            )
            rows = read_metrics(run_dir)[2:]  # skip warm-up (and the first one-step-off step, which cannot overlap)
            generation = "timing_s/gen" if mode == "sync" else "timing_s/generate_async"
            step = statistics.median(row["timing_s/step"] for row in rows)
            gen = statistics.median(row[generation] for row in rows)
            waited = statistics.median(row["timing_s/gen"] for row in rows)
            training = statistics.median(row["timing_s/step"] - row["timing_s/gen"] for row in rows)
            results[mode] = {
                "step_s": round(step, 3),
                "generation_s": round(gen, 3),
                "training_s": round(training, 3),
                "waited_for_generation_s": round(waited, 3),
            }
    ray.shutdown()
    sync, off = results["sync"], results["one_step_off"]
    ideal = max(sync["generation_s"], sync["training_s"])
    summary = {
        "speedup": round(sync["step_s"] / off["step_s"], 2),
        "ideal_step_s": round(ideal, 3),
        "one_step_off_vs_ideal": round(off["step_s"] / ideal, 2),
    }
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; medians of {args.steps - 2} steps")
    print("| mode | step s | generation s | training s | waited for generation s |\n|---|---|---|---|---|")
    for mode, row in results.items():
        print(
            f"| {mode} | {row['step_s']} | {row['generation_s']} | {row['training_s']} "
            f"| {row['waited_for_generation_s']} |"
        )
    print(
        f"sync / one_step_off step time: {summary['speedup']}x; one_step_off step = "
        f"{summary['one_step_off_vs_ideal']} x max(generation, training) = {summary['ideal_step_s']} s"
    )
    print(json.dumps({"modes": results, **summary}))


if __name__ == "__main__":
    main()
