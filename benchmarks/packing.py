"""Padded row-count micro-batches against packed sequences in token-budget micro-batches, on a long-tailed batch.

The actor (in process, float32, no gradient checkpointing) of vs_trl.py's random-init ``25m`` Qwen2 (hidden 512,
8 layers, the demo's 32-character vocabulary) computes the log-probs of ``--sequences`` responses of 8 to
``--max-response`` tokens (most short: 8 + (max - 8) * u^6) after prompts of 4 to 16 tokens, then makes one
update on them: ``padded`` in micro-batches of ``--micro`` rows, ``packed`` with ``use_remove_padding`` and
``use_dynamic_bsz`` in micro-batches of at most ``--budget`` tokens. Each setting runs in a fresh process,
alternating ``--repeats`` times; reported: the best seconds of each pass, the ratio, the tokens each forward
processes, the peak RSS, the load average. Method and figures: docs/benchmarks.md#padding-free-token-budget-batches.

    python benchmarks/packing.py [--sequences 32] [--max-response 512] [--micro 8] [--budget 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vs_trl import build_model, parameter_count  # benchmarks/ is the script's folder

PROMPT = 16


def long_tailed_batch(sequences: int, max_response: int, *, prompt: int = PROMPT, vocab: int = 32, samples: int = 1):
    """Prompts of 4 to ``prompt`` tokens (left-padded), each for ``samples`` consecutive rows (a GRPO group);
    responses of 8 to ``max_response`` (one of each extreme; most short: 8 + (max - 8) * u^6), token ids from 4 to
    ``vocab``, random advantages."""
    import torch
    from tensordict import TensorDict

    generator = torch.Generator().manual_seed(0)
    lengths = (8 + (max_response - 8) * torch.rand(sequences, generator=generator) ** 6).long()
    lengths[0], lengths[1] = 8, max_response
    groups = sequences // samples
    prompt_lengths = torch.randint(4, prompt + 1, (groups,), generator=generator).repeat_interleave(samples)
    prompt_mask = torch.arange(prompt) >= (prompt - prompt_lengths).unsqueeze(1)
    response_mask = torch.arange(max_response) < lengths.unsqueeze(1)
    tokens = lambda rows, width: torch.randint(4, vocab, (rows, width), generator=generator)  # noqa: E731
    prompts = tokens(groups, prompt).repeat_interleave(samples, dim=0)
    return TensorDict(
        {
            "prompts": prompts * prompt_mask,
            "prompt_mask": prompt_mask,
            "responses": tokens(sequences, max_response) * response_mask,
            "response_mask": response_mask,
            "advantages": torch.randn(sequences, max_response, generator=generator) * response_mask,
        },
        batch_size=[sequences],
    )


def overrides(args, model_dir: Path, setting: str) -> list[str]:
    words = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"data.train_batch_size={args.sequences // 2}",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.sequences // 2}",
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={args.max_response}",
        f"actor_rollout_ref.actor.resources.num_threads={args.threads}",
    ]
    if setting == "padded":
        return words + [
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
        ]
    return words + [
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.budget}",
    ]


def forward_tokens(batch, actor) -> int:
    """Token positions the actor's forward passes process: padded micro-batches' P x (prompt + longest response)
    width, or the packed sequences' real tokens."""
    from ppoflow.workers.training.learner import micro_batches
    from ppoflow.workers.training.packing import sequence_lengths

    cuts = micro_batches(batch, actor.parallel, size=actor.micro_batch_size, max_tokens=actor.max_token_len)
    if actor.remove_padding:
        return sum(sum(sequence_lengths(micro)) for _, micro in cuts)
    return sum(len(micro) * (micro["prompts"].shape[1] + micro["responses"].shape[1]) for _, micro in cuts)


def measure(args, model_dir: Path, setting: str) -> dict[str, float]:
    """In this (fresh) process: the actor's log-prob pass and one update; seconds, peak RSS and a checksum."""
    import resource
    import time

    from ppoflow.configs import load_config
    from ppoflow.workers.training.policy import ActorWorker

    actor = ActorWorker(load_config("grpo_tiny", overrides(args, model_dir, setting)))
    batch = long_tailed_batch(args.sequences, args.max_response)
    actor.compute_log_prob(batch[:2])  # warm-up: the first forward pass's one-time costs
    started = time.perf_counter()
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    log_prob_s = time.perf_counter() - started
    started = time.perf_counter()
    metrics = actor.update(batch, step=1).metrics
    update_s = time.perf_counter() - started
    return {
        "log_prob_s": log_prob_s,
        "update_s": update_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens": forward_tokens(batch, actor),
        "mean_log_prob": float(batch["old_log_probs"][batch["response_mask"]].mean()),
        "pg_loss": metrics["actor/pg_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=512)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--scratch", default=str(Path(tempfile.gettempdir()) / "ppoflow-bench-packing"))
    parser.add_argument("--child", choices=["padded", "packed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    model_dir = build_model(Path(args.scratch), "25m")
    if args.child:
        print(json.dumps(measure(args, model_dir, args.child)))
        return
    runs: dict[str, list[dict]] = {"padded": [], "packed": []}
    words = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items() if name != "child"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TRANSFORMERS_VERBOSITY": "error"}
    loads = []
    for _ in range(args.repeats):
        for setting in runs:
            loads.append(os.getloadavg()[0])
            done = subprocess.run([sys.executable, __file__, *words, "--child", setting], capture_output=True,
                                  text=True, check=True, env=env)  # fmt: skip
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = {setting: {name: min(run[name] for run in rows) for name in rows[0]} for setting, rows in runs.items()}
    print(f"load average {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores, {args.threads} threads; "
          f"{parameter_count(model_dir) / 1e6:.1f}M-parameter Qwen2; {args.sequences} sequences, responses "
          f"8-{args.max_response}; padded: {args.micro} rows, packed: {args.budget} tokens; "
          f"best of {args.repeats}")  # fmt: skip
    print("| | forward tokens | log-prob s | update s | total s | speed-up | peak RSS MiB | mean log-prob | pg_loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    total = {setting: row["log_prob_s"] + row["update_s"] for setting, row in best.items()}
    for setting, row in best.items():
        print(f"| {setting} | {row['tokens']} | {row['log_prob_s']:.2f} | {row['update_s']:.2f} | "
              f"{total[setting]:.2f} | {total['padded'] / total[setting]:.2f} | {row['peak_rss_mib']:.0f} | "
              f"{row['mean_log_prob']:.5f} | {row['pg_loss']:.5f} |")  # fmt: skip


if __name__ == "__main__":
    main()
