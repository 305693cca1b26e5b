"""A step's forward passes side by side against one after another.

With a critic and KL terms a step makes three forward passes (``old_log_prob``, ``ref_log_prob``, ``values``) on
three workers; ppoflow submits them together (``Stages.together``), the baseline one after another. Both run
``ppoflow train``'s way on the demo with those terms, against a Prefect server of the benchmark's own, alternating
twice. Reported: the median step, its ratio to the baseline, each pass's median ``timing_s`` and the load.
Method and figures: docs/benchmarks.md#a-steps-forward-passes-side-by-side.

    python benchmarks/forward_passes.py [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import built_in, local_prefect_server, ppoflow_steps, start_local_ray  # noqa: E402 (benchmarks/ is the script's folder)

TERMS = [
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "algorithm.use_kl_in_reward=true",
    "critic.model.build.seed=0",
]  # the critic starts from the demo model (built there if missing)
PASSES = ("old_log_prob", "ref", "values")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    import ray

    from ppoflow.configs import load_config
    from ppoflow.flows.stages import Stages

    class OneAfterAnother(Stages):
        """The baseline: each pass awaited before the next is started."""

        def together(self, step, calls):
            for call in calls:
                self._call(step, call)

    start_local_ray()
    rows: dict[str, list[dict[str, float]]] = {"one after another": [], "side by side": []}
    with tempfile.TemporaryDirectory() as scratch, local_prefect_server(scratch):
        cfg = load_config(
            "grpo_tiny",
            built_in(scratch, "demo") + TERMS + [f"trainer.default_local_dir={scratch}/run", "trainer.test_freq=-1"],
        )
        for _ in range(2):
            for way, stages_type in (("one after another", OneAfterAnother), ("side by side", Stages)):
                steps = ppoflow_steps(
                    cfg, ray_workers=True, prefect_tasks=True, steps=args.warmup + args.steps, stages_type=stages_type
                )
                rows[way] += steps[args.warmup :]
    ray.shutdown()

    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; medians of 2 x {args.steps} steps "
        f"after {args.warmup} warm-up each; ms"
    )
    print("| way | step | x one after another | " + " | ".join(PASSES) + " |\n|---|---|---|" + "---|" * len(PASSES))
    baseline = statistics.median(row["timing_s/step"] for row in rows["one after another"])
    for way, measured in rows.items():
        step = statistics.median(row["timing_s/step"] for row in measured)
        passes = " | ".join(
            f"{statistics.median(row[f'timing_s/{name}'] for row in measured) * 1000:.1f}" for name in PASSES
        )
        print(f"| {way} | {step * 1000:.1f} | {step / baseline:.2f} | {passes} |")


if __name__ == "__main__":
    main()
