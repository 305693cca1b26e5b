"""Samples per second of the layouts a sync GRPO step can run in on two CPU cores, alternating in one run.

The same random-init Qwen2 (vs_trl.py's ``25m`` shape, or ``qwen0.5b``) on the same copy-task prompts, each layout a
``ppoflow train`` of its own against one Prefect server, one torch thread per process:
- ``colocated W=2``: verl's hybrid engine, two actor ranks (FSDP2 over gloo), each sampling half of the prompts with
  the full weights gathered from its shards, then training on its half of the batch;
- ``separate``: one actor rank and one rollout worker (``hybrid_engine=false``): each waits while the other works;
- ``colocated W=1``: one process generates and trains.
Reported per layout: trained samples/s (over the median step), its ratios, the stage medians and the peak RSS per
process (``perf/<role>/max_rss_gb``), the load printed around each run. Figures: docs/benchmarks.md#colocated-ranks.

    python benchmarks/colocated_ranks.py [--shape 25m] [--steps 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from vs_trl import DIGITS, PPOFLOW, SHAPES, bfloat16_instructions, build_model, parameter_count, write_prompts  # noqa: E402
from workloads import local_prefect_server, timing_medians  # noqa: E402

LAYOUTS = {
    "colocated W=2": ["trainer.n_cpu_ranks_per_node=2", "actor_rollout_ref.hybrid_engine=true"],
    "separate": ["actor_rollout_ref.hybrid_engine=false"],
    "colocated W=1": ["actor_rollout_ref.hybrid_engine=true"],
}
"""Label -> the layout's overrides (each process of each layout: one CPU, one torch thread)."""


def overrides(args, model_dir: Path, prompts_file: Path, run_dir: Path) -> list[str]:
    """The sync GRPO step every layout runs: vs_trl.py's batch for the shape, nothing but generate and update."""
    shape = SHAPES[args.shape]
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.build=null",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"data.train_files={prompts_file}",
        "data.val_files=null",
        "data.synthetic=null",
        "data.shuffle=false",
        f"data.train_batch_size={shape['prompts']}",
        f"data.max_prompt_length={DIGITS + 1}",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={shape['prompts']}",
        f"actor_rollout_ref.rollout.n={shape['samples']}",
        f"actor_rollout_ref.rollout.dtype={args.rollout_dtype}",
        "actor_rollout_ref.actor.entropy_coeff=0.0",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        *(f"actor_rollout_ref.{role}.resources.{key}=1" for role in ("actor", "rollout")
          for key in ("num_cpus", "num_threads")),
        f"trainer.total_training_steps={args.warmup + args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={run_dir}",
    ]  # fmt: skip


def run_layout(args, label: str, model_dir: Path, prompts_file: Path, run_dir: Path, env: dict) -> dict:
    """One ``ppoflow train`` of the layout ``label``: its measured steps' rate, stage medians and peaks per role."""
    from ppoflow.flows.tracking import read_metrics

    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover run dir would resume, not rerun
    command = [
        *PPOFLOW,
        "train",
        "--config",
        "grpo_tiny",
        *overrides(args, model_dir, prompts_file, run_dir),
        *LAYOUTS[label],
    ]
    log = run_dir.with_suffix(".log")
    with open(log, "w") as output:
        code = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        raise SystemExit(f"{label} exited {code}; its output: {log}")
    rows = [row for row in read_metrics(str(run_dir)) if row["step"] > args.warmup]
    shape = SHAPES[args.shape]
    step_s = statistics.median(row["timing_s/step"] for row in rows)
    peaks = {
        name.split("/")[1]: max(row[name] for row in rows)
        for name in rows[0]
        if name.startswith("perf/") and name.endswith("/max_rss_gb")
    }
    engine = {name.split("/")[-1]: max(row[name] for row in rows) for name in rows[0] if "/rollout_" in name}
    return {
        "samples_per_s": shape["prompts"] * shape["samples"] / step_s,
        "step_s": step_s,
        "stages": {name: seconds for name, seconds in timing_medians(rows).items() if name != "step"},
        "peak_rss_gb": peaks,
        "engine_gb": engine,
        "response_length": statistics.mean(row["response_length/mean"] for row in rows),
    }


def report(runs: dict[str, list[dict]]) -> None:
    """Each layout's median rate, its ratio to the others, where its step goes and its memory per process."""
    rate = {label: statistics.median(run["samples_per_s"] for run in results) for label, results in runs.items()}
    print("\n| layout | samples/s | x separate | x colocated W=1 | peak RSS per process GB | response tokens |")
    print("|---|---|---|---|---|---|")
    for label, results in runs.items():
        last = results[-1]
        peaks = ", ".join(f"{role} {gb:.2f}" for role, gb in last["peak_rss_gb"].items())
        print(f"| {label} | {rate[label]:.1f} | {rate[label] / rate['separate']:.2f} "
              f"| {rate[label] / rate['colocated W=1']:.2f} | {peaks} | {last['response_length']:.1f} |")  # fmt: skip
    for label, results in runs.items():
        last = results[-1]
        stages = ", ".join(f"{name} {seconds:.2f}" for name, seconds in last["stages"].items())
        engine = ", ".join(f"{name} {gb:.2f}" for name, gb in last["engine_gb"].items())
        print(f"{label}, last run: stage medians s: {stages}" + (f"\n  engine RSS GB: {engine}" if engine else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="25m")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run, after --warmup")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="every layout in turn, this many times")
    parser.add_argument("--response-length", type=int, help="max response tokens (default: the shape's)")
    parser.add_argument("--rollout-dtype", default="float32", help="rollout.dtype of every layout")
    parser.add_argument("--scratch", default="outputs/bench/vs_trl", help="models, prompts and run directories")
    args = parser.parse_args()
    args.response_length = args.response_length or SHAPES[args.shape]["response_length"]
    scratch = Path(args.scratch).resolve()
    (scratch / "runs").mkdir(parents=True, exist_ok=True)
    model_dir = build_model(scratch, args.shape)
    shape = SHAPES[args.shape]
    prompts_file = write_prompts(scratch, max(256, 2 * shape["prompts"] * (args.warmup + args.steps)))
    print(f"{args.shape}: Qwen2 {parameter_count(model_dir) / 1e6:.1f}M params; {shape['prompts']} prompts x "
          f"{shape['samples']} samples a step, {args.response_length} response tokens at most, rollout.dtype "
          f"{args.rollout_dtype}; {args.warmup} warm-up + {args.steps} measured steps; {os.cpu_count()} cores, "
          f"{bfloat16_instructions()}", flush=True)  # fmt: skip
    runs: dict[str, list[dict]] = {label: [] for label in LAYOUTS}
    with local_prefect_server(str(scratch)):
        from prefect.settings import PREFECT_API_URL

        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PREFECT_API_URL": PREFECT_API_URL.value()}
        for repeat in range(1, args.repeats + 1):
            for label in LAYOUTS:
                run_dir = scratch / "runs" / f"colocated-{args.shape}-{label.replace(' ', '').replace('=', '')}"
                before = os.getloadavg()[0]
                result = run_layout(args, label, model_dir, prompts_file, run_dir, env)
                print(f"{label} {repeat}: {result['samples_per_s']:.1f} samples/s ({result['step_s']:.2f} s/step); "
                      f"load {before:.2f} before, {os.getloadavg()[0]:.2f} after", flush=True)  # fmt: skip
                runs[label].append(result)
    report(runs)


if __name__ == "__main__":
    main()
