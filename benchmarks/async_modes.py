"""Trained samples per second of the four trainer modes on one long-tailed workload, in one run.

A randomly initialised 10.5M-parameter Llama (``workloads.py``'s ``larger``), trained with a learning rate too small
to change it, so its response lengths keep a random model's long tail; 4 prompts x 3 samples a step, the rollout
service (one replica) and the actor on one CPU each. Each mode trains ``--steps`` steps as ``ppoflow train`` runs it
(separate_async also with ``parameter_sync_step=2``); reported per mode: trained samples/s and the ratio to sync,
the waits for generation, the update time, response lengths and staleness.
Method and figures: docs/benchmarks.md#trainer-modes-on-a-long-tail.

    python benchmarks/async_modes.py [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import WORKLOADS, built_in, start_local_ray  # noqa: E402 (benchmarks/ is the script's folder)

PROMPTS, SAMPLES = 4, 3
"""A step's prompts and samples per prompt."""
WORKLOAD = [
    *WORKLOADS["larger"],
    "data.max_response_length=112",
    "actor_rollout_ref.model.build.max_position_embeddings=128",
    f"data.train_batch_size={PROMPTS}",
    f"actor_rollout_ref.rollout.n={SAMPLES}",
    "actor_rollout_ref.actor.optim.lr=1.0e-9",
    "actor_rollout_ref.rollout.mode=async",
    "trainer.test_freq=-1",
    "trainer.logger=[]",
    "trainer.save_freq=-1",
]
WHOLE_BATCH = [f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}"]
MODES = {
    "sync": ("sync", WHOLE_BATCH),
    "one_step_off": ("one_step_off", WHOLE_BATCH),
    "colocate_async": ("colocate_async", WHOLE_BATCH),
    "separate_async": ("separate_async", [*WHOLE_BATCH, "trainer.v1.separate_async.parameter_sync_step=1"]),
    "separate_async P=2": (
        "separate_async",
        [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS // 2}",
            "trainer.v1.separate_async.parameter_sync_step=2",
        ],
    ),
}
"""Label -> (trainer mode, its overrides). separate_async with one update per weight push, and with two
(``parameter_sync_step=2``: the second update's old log-probs need a forward pass of their own)."""
SKIPPED = 2
"""Leading steps left out of the rates (start-up, the first batch that nothing could overlap)."""


def trained(label: str, scratch: str, steps: int) -> dict[str, float]:
    """Run the mode ``label`` names on the workload; its rate and the lengths and staleness of what it
    trained on."""
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    mode, words = MODES[label]
    run_dir = f"{scratch}/{label.replace(' ', '_')}"
    ppo_train(
        config="grpo_tiny",
        overrides=WORKLOAD
        + built_in(scratch, "larger")
        + words
        + [f"trainer.mode={mode}", f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}"],
    )
    rows = read_metrics(run_dir)[SKIPPED:]
    staleness = [row.get("training/off_policy/trajectory_staleness/mean", 0.0) for row in rows]
    return {
        "samples_per_s": len(rows) * PROMPTS * SAMPLES / sum(row["timing_s/step"] for row in rows),
        "waited_s": statistics.median(row["timing_s/gen"] for row in rows),
        "update_s": statistics.median(
            row["timing_s/update_actor"] + row.get("timing_s/old_log_prob", 0.0) for row in rows
        ),
        "response_length_mean": sum(row["response_length/mean"] for row in rows) / len(rows),
        "response_length_max": max(row["response_length/max"] for row in rows),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(row.get("training/off_policy/trajectory_staleness/max", 0.0) for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    steps = parser.parse_args().steps
    start_local_ray()
    with tempfile.TemporaryDirectory() as scratch:
        results = {label: trained(label, scratch, steps) for label in MODES}
    baseline = results["sync"]["samples_per_s"]
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {steps} steps per mode, "
        f"the first {SKIPPED} left out"
    )
    print(
        "| mode | trained samples/s | vs sync | waited for generation s | update s | response length mean / max "
        "| staleness mean / max |\n|---|---|---|---|---|---|---|"
    )
    for mode, row in results.items():
        print(
            f"| {mode} | {row['samples_per_s']:.2f} | {row['samples_per_s'] / baseline:.2f}x | "
            f"{row['waited_s']:.2f} | {row['update_s']:.2f} | "
            f"{row['response_length_mean']:.1f} / {row['response_length_max']:.0f} | "
            f"{row['staleness_mean']:.2f} / {row['staleness_max']:.0f} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
