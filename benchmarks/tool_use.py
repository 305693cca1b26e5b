"""Tool use on the CPU: the vault task (ppoflow/data/vault.py) trained with the tool and without it.

For each seed, two runs of the ``vault_tool`` preset as ``ppoflow train`` runs it, from the same random-init model
and prompts: ``tool`` (``tool_agent`` with the ``vault`` tool), ``no tool`` (``single_turn_agent``, no tools) and
``openai agent`` (the tool called by ``data/vault_agent.py``, an OpenAI-SDK program, through the gateway).
Reported per run: greedy validation reward on vault keys after each quarter, training reward, exact-answer rate
and tool-call share (``agent/tool_call_ratio``) over the first and last 10 steps. Figures: docs/benchmarks.md#tool-use.

    python benchmarks/tool_use.py [--seeds 0 1 2] [--steps 500] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

WINDOW = 10
VALIDATION = "val-core/synthetic/vault/reward/mean@1"
"""Greedy reward on the validation keys (vault rows only), after every quarter of the run."""
VARIANTS = {
    "tool": [],
    "no tool": [
        "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=null",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
    ],
    "openai agent": [  # the tool through the gateway: data/vault_agent.py, a plain OpenAI-SDK program
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
        "actor_rollout_ref.rollout.agent.gateway.enable=true",
        "actor_rollout_ref.rollout.agent.agent_function.path=ppoflow.data.vault_agent:agent",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=null",
    ],
}


def window_mean(rows: list[dict], name: str, last: bool) -> float:
    """Mean of metric ``name`` over the first (or last) ``WINDOW`` steps (0 where a step lacks it)."""
    window = rows[-WINDOW:] if last else rows[:WINDOW]
    return sum(row.get(name, 0.0) for row in window) / len(window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    parser.add_argument("--variants", nargs="+", default=["tool", "no tool"], choices=list(VARIANTS))
    args = parser.parse_args()

    import ray

    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for variant in args.variants:
                run_dir = f"{scratch}/run{seed}-{variant.replace(' ', '_')}"
                started = time.perf_counter()
                ppo_train(
                    config="vault_tool",
                    overrides=[
                        f"actor_rollout_ref.model.path={scratch}/model{seed}",
                        f"actor_rollout_ref.model.build.seed={seed}",
                        f"data.train_files={scratch}/train.parquet",
                        "data.synthetic.seed=0",
                        f"data.val_files={scratch}/val.parquet",
                        f"trainer.test_freq={args.steps // 4}",
                        f"data.seed={seed}",
                        f"actor_rollout_ref.rollout.seed={seed}",
                        "trainer.logger=[]",
                        f"trainer.total_training_steps={args.steps}",
                        "trainer.save_freq=-1",
                        f"trainer.default_local_dir={run_dir}",
                        *args.set,
                        *VARIANTS[variant],
                    ],
                )
                rows = read_metrics(run_dir)
                validations = [row[VALIDATION] for row in rows if VALIDATION in row]
                rows = [row for row in rows if "critic/score/mean" in row]
                results.append(
                    {
                        "seed": seed,
                        "variant": variant,
                        "wall_s": time.perf_counter() - started,
                        "validations": validations,
                        **{
                            f"{name}_{part}": window_mean(rows, metric, last)
                            for name, metric in (
                                ("reward", "critic/score/mean"),
                                ("exact", "reward/exact/mean"),
                                ("tool_calls", "agent/tool_call_ratio"),
                            )
                            for part, last in (("first", False), ("last", True))
                        },
                    }
                )
    ray.shutdown()
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {args.steps} steps per run; "
        f"means over the first and last {WINDOW} steps"
    )
    print(
        "| seed | run | validation reward by quarter | train reward first -> last | exact answers first -> last "
        "| tool-call share first -> last | wall s |\n|---|---|---|---|---|---|---|"
    )
    for row in results:
        print(
            f"| {row['seed']} | {row['variant']} | {' / '.join(f'{value:.2f}' for value in row['validations'])} | "
            f"{row['reward_first']:.3f} -> {row['reward_last']:.3f} | "
            f"{row['exact_first']:.3f} -> {row['exact_last']:.3f} | "
            f"{row['tool_calls_first']:.3f} -> {row['tool_calls_last']:.3f} | {row['wall_s']:.0f} |"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
