"""How far a ppoflow step is from the floor: a single-process GRPO loop on the same model, data and batch.

The floor is the loop one would write by hand (``model.generate``, the copy scorer, GRPO advantages, one
forward/backward with ppoflow's clipped loss, one AdamW step; no Ray, no Prefect). ppoflow then runs the same config
each way it can (bare, ray, prefect+ray, one_step_off, tagged task runs, Prefect's default server) plus two pieces
alone (no-op task runs, a progress update per step); each way's median, mean and slowest step against the floor,
the task runs per step, and the CPU per step of the driver, Ray's workers and the benchmark's own Prefect server.
What each way is and how the CPU is counted (:data:`SERVER_SETTLE_S`): docs/benchmarks.md#a-step-against-the-floor.

    python benchmarks/step_floor.py [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import (  # noqa: E402 (benchmarks/ is the script's folder)
    CpuMeter,
    built_in,
    local_prefect_server,
    ppoflow_steps,
    progress_updates_alone,
    task_run_names_of_last_flow_run,
    task_runs_alone,
    timing_medians,
)

SERVER_SETTLE_S = 6.0
"""How long the CPU counters wait, before the timed steps and after them, for the Prefect server to
finish with what it was sent: it records task runs from their state events in the background, its
task-run recorder flushing at least every second and its event persister every 5 s, so the CPU a step's
task runs cost it is spent after the step (outside the steps' timing, which this wait is too)."""


def floor_steps(cfg, *, steps: int, after_step=None) -> list[dict[str, float]]:
    """The hand-written loop, ``steps`` times; per step ``timing_s/{gen,reward,update_actor,step}``;
    ``after_step`` is called with each finished step's number (from 1)."""
    import torch

    from ppoflow.algorithms.advantages import compute_grpo_outcome_advantage
    from ppoflow.algorithms.losses import log_probs_and_entropy
    from ppoflow.algorithms.policy_losses import compute_policy_loss
    from ppoflow.algorithms.scoring import copy_score
    from ppoflow.data.datasets import ensure_datasets, load_prompt_dataset
    from ppoflow.storage.batch import non_tensor_column
    from ppoflow.workers.models import ensure_model, load_causal_lm, load_tokenizer, set_up_worker_process

    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    set_up_worker_process(actor.resources)
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    ensure_datasets(cfg.data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    model = load_causal_lm(cfg.actor_rollout_ref.model)
    dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=actor.optim.lr, betas=tuple(actor.optim.betas), weight_decay=actor.optim.weight_decay
    )
    size, n, eos = cfg.data.train_batch_size, rollout.n, tokenizer.eos_token_id
    rows = []
    for step in range(steps):
        timing: dict[str, float] = {}
        start = time.perf_counter()
        picked = [(step * size + i) % len(dataset) for i in range(size)]
        prompts = dataset.batch(picked, [str(i) for i in picked], tokenizer.pad_token_id)
        input_ids = prompts["prompts"].repeat_interleave(n, dim=0)
        prompt_mask = prompts["prompt_mask"].repeat_interleave(n, dim=0).long()
        # 1. generate
        model.eval()
        with torch.no_grad():
            sequences = model.generate(
                input_ids=input_ids,
                attention_mask=prompt_mask,
                do_sample=True,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                top_k=max(rollout.top_k, 0),
                max_new_tokens=cfg.data.max_response_length,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
        responses = sequences[:, input_ids.shape[1] :]
        is_eos = responses == eos
        response_mask = ((is_eos.cumsum(dim=1) - is_eos.long()) == 0).long()  # up to and including the first EOS
        timing["gen"] = time.perf_counter() - start
        # 2. reward, on the last token
        mark = time.perf_counter()
        lengths = response_mask.sum(dim=1)
        texts = tokenizer.batch_decode([r[: k - int(r[k - 1] == eos)].tolist() for r, k in zip(responses, lengths)])
        truths = [truth for truth in non_tensor_column(prompts, "ground_truth") for _ in range(n)]
        scores = torch.tensor([copy_score("copy", text, truth)["score"] for text, truth in zip(texts, truths)])
        rewards = torch.zeros(responses.shape, dtype=torch.float32)
        rewards[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = scores
        timing["reward"] = time.perf_counter() - mark
        # 3. advantage, 4. one on-policy update
        mark = time.perf_counter()
        advantages, _ = compute_grpo_outcome_advantage(
            rewards, response_mask, torch.arange(size).repeat_interleave(n), cfg.algorithm.norm_adv_by_std_in_grpo
        )
        model.train()
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = (
            model(
                input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits[:, input_ids.shape[1] - 1 : -1]
            / rollout.temperature
        )
        log_probs = log_probs_and_entropy(logits.flatten(0, 1), responses.flatten(), with_entropy=False)[0].view_as(
            responses
        )
        loss, _ = compute_policy_loss(
            log_probs.detach(),
            log_probs,
            advantages,
            response_mask,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
            loss_agg_mode=actor.loss_agg_mode,
            loss_scale_factor=cfg.data.max_response_length,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), actor.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timing["update_actor"] = time.perf_counter() - mark
        timing["step"] = time.perf_counter() - start
        rows.append({f"timing_s/{name}": seconds for name, seconds in timing.items()})
        if after_step is not None:
            after_step(step + 1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    import logging

    import ray

    from ppoflow.configs import load_config

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    total = args.warmup + args.steps
    ways = {
        "bare": (False, False, "sync", False, True),
        "ray": (True, False, "sync", False, True),
        "prefect+ray": (True, True, "sync", False, True),
        "one_step_off": (True, True, "one_step_off", False, True),
        "prefect+ray+tags": (True, True, "sync", True, True),
        "prefect+ray, Prefect's default server": (True, True, "sync", False, False),
    }
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:

        def config(mode: str, tags: bool = False):
            return load_config(
                "grpo_tiny",
                built_in(scratch, "demo")
                + [
                    f"trainer.default_local_dir={scratch}/run-{mode}",
                    f"trainer.mode={mode}",
                    "trainer.test_freq=-1",
                    f"trainer.task_run_tags={str(tags).lower()}",
                ],
            )

        def measured(run_steps, server_pid: int | None = None) -> dict[str, float]:
            """The medians of the steps after the warm-up, their mean and slowest step, and the CPU each
            process spent per step over them."""
            marks, meter = {}, CpuMeter(server_pid)

            def settled_mark(number: int) -> None:
                """Read the counters after the warm-up and after the last step (the server settled first)."""
                if number not in (args.warmup, total):
                    return
                if server_pid is not None:
                    time.sleep(SERVER_SETTLE_S)
                marks[number] = meter.mark()

            rows = run_steps(after_step=settled_mark)[args.warmup :]
            steps = [row["timing_s/step"] for row in rows]
            return {
                **timing_medians(rows),
                "step_mean": sum(steps) / len(steps),
                "step_max": max(steps),
                **CpuMeter.per_step(marks[args.warmup], marks[total], args.steps),
            }

        results["floor"] = measured(partial(floor_steps, config("sync"), steps=total))
        for tuned in (True, False):
            with local_prefect_server(scratch, tuned=tuned) as server_pid:
                for way, (ray_workers, prefect_tasks, mode, tags, tuned_server) in ways.items():
                    if tuned_server == tuned:
                        results[way] = measured(
                            partial(
                                ppoflow_steps,
                                config(mode, tags),
                                ray_workers=ray_workers,
                                prefect_tasks=prefect_tasks,
                                steps=total,
                            ),
                            server_pid,
                        )
                        if prefect_tasks:
                            names = task_run_names_of_last_flow_run()
                            results[way]["task_runs"] = len(names) / total
                            if way == "prefect+ray":
                                sync_stages = [name.split("[")[0] for name in names if name.endswith(f"[step={total}]")]
                if tuned:
                    results["task runs alone"] = measured(
                        partial(task_runs_alone, sync_stages, steps=total), server_pid
                    )
                    results["task runs alone"]["task_runs"] = float(len(sync_stages))
                    results["a progress update per step, alone"] = measured(
                        lambda after_step: progress_updates_alone(steps=total, after_step=after_step), server_pid
                    )
    ray.shutdown()

    floor = results["floor"]["step"]
    stages = ["gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights"]
    cpu = ["cpu_driver", "cpu_ray", "cpu_server"]
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; medians of {args.steps} steps "
        f"after {args.warmup} (and the steps' mean and slowest); CPU ms per step of the driver, Ray's "
        f"processes and the Prefect server over the same steps; ms"
    )
    print(
        "| way | step | x floor | mean step | slowest | task runs | " + " | ".join(stages + cpu) + " |\n"
        "|---|---|---|---|---|---|" + "---|" * len(stages + cpu)
    )
    for way, timing in results.items():
        split = " | ".join(f"{timing[name] * 1000:.1f}" if name in timing else "-" for name in stages + cpu)
        runs = f"{timing['task_runs']:.1f}" if "task_runs" in timing else "-"
        print(
            f"| {way} | {timing['step'] * 1000:.1f} | {timing['step'] / floor:.2f} | "
            f"{timing['step_mean'] * 1000:.1f} | {timing['step_max'] * 1000:.1f} | {runs} | {split} |"
        )
    alone, idle = results["task runs alone"], results["bare"]["cpu_server"]  # bare: the server with no task runs
    print(
        f"floor + task runs alone: {(floor + alone['step']) * 1000:.1f} ms = {1 + alone['step'] / floor:.2f}x "
        f"the floor "
        f"({alone['task_runs']:.0f} task runs at {alone['step'] / alone['task_runs'] * 1000:.1f} ms each in the flow's "
        f"thread; the server spends {(alone['cpu_server'] - idle) / alone['task_runs'] * 1000:.1f} ms of CPU on each "
        f"beyond the {idle * 1000:.1f} ms a step it spends with no task runs, as in the bare row)"
    )
    print(json.dumps({way: {**timing, "ratio_to_floor": timing["step"] / floor} for way, timing in results.items()}))


if __name__ == "__main__":
    main()
