"""Learning from a reward model alone: GRPO on the built-in ``prefer`` task, whose prompts no rule scores, with a
tiny reward model trained first to score the share of the response budget filled with the letter ``a``.

The reward model is trained once (seed 0; its mean absolute error on held-out responses is printed); each seed
then trains the demo's tiny policy (built with that seed; data order and sampling seeded too) with
``reward_model.enable=true`` for ``--steps`` steps. Reported per seed: the reward model's mean score of the
responses trained on (``critic/score/mean``) and their true share of ``a`` (from the generation dumps,
``trainer.rollout_data_dir``), over the first and the last 5 steps:

    python benchmarks/reward_model_learning.py [--seeds 0 1 2] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BUDGET = 4
"""Response tokens: the policy's data.max_response_length and the reward model's budget."""
WINDOW = 5


def task_overrides(scratch: str, reward_model: str, seed: int, steps: int) -> list[str]:
    """The demo (grpo_tiny) on the ``prefer`` task, scored by the reward model alone, for ``seed``."""
    return [
        f"actor_rollout_ref.model.path={scratch}/model{seed}",
        f"actor_rollout_ref.model.build.seed={seed}",
        f"data.train_files={scratch}/prefer_train.parquet",
        "data.val_files=null",
        "data.synthetic.task=prefer",
        f"data.max_response_length={BUDGET}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        "reward_model.enable=true",
        f"reward_model.model.path={reward_model}",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={scratch}/run{seed}",
        f"trainer.rollout_data_dir={scratch}/dumps{seed}",
    ]


def share_by_step(dumps: str) -> dict[int, float]:
    """Each step's mean true share of ``a`` over the responses it trained on (its generation dump)."""
    from ppoflow.workers.preference_model import preferred_share

    shares = {}
    for name in os.listdir(dumps):
        rows = [json.loads(line) for line in open(os.path.join(dumps, name))]
        shares[rows[0]["step"]] = sum(preferred_share(row["output"], BUDGET) for row in rows) / len(rows)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    import ray

    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train
    from ppoflow.workers.preference_model import train_preference_model

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        reward_model = f"{scratch}/preference_rm"
        spec = TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64
        )
        error = train_preference_model(reward_model, spec, budget=BUDGET)
        print(f"reward model: mean absolute error {error:.3f} on held-out responses")
        for seed in args.seeds:
            ppo_train(config="grpo_tiny", overrides=task_overrides(scratch, reward_model, seed, args.steps))
            rows = read_metrics(f"{scratch}/run{seed}")
            scores = [row["critic/score/mean"] for row in rows]
            shares = share_by_step(f"{scratch}/dumps{seed}")
            share = [shares[row["step"]] for row in rows]
            results[seed] = {
                "rm_score_first": sum(scores[:WINDOW]) / WINDOW,
                "rm_score_last": sum(scores[-WINDOW:]) / WINDOW,
                "share_a_first": sum(share[:WINDOW]) / WINDOW,
                "share_a_last": sum(share[-WINDOW:]) / WINDOW,
            }
            print(json.dumps({"seed": seed, **results[seed]}), flush=True)
    ray.shutdown()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
