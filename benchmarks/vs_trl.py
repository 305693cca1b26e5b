"""ppoflow side by side with TRL's GRPOTrainer at realistic shapes: s/step and the whole run's peak memory.

Both sides train the same random-init Qwen2 (built once into ``--scratch``: ``25m``, hidden 512 x 8 layers, or
``qwen0.5b``, Qwen2.5-0.5B's layer shapes with the demo's 32-character vocabulary) on the same copy-task prompts
and ppoflow's copy scorer: GRPO, one optimizer step per batch (prompts x samples), no KL, float32, the same
response length, AdamW settings and torch threads. ppoflow runs as a user runs it (``ppoflow train``, sync
defaults, Ray local, the benchmark's own Prefect server); TRL in a process of its own (benchmarks/trl_side.py).
The sides alternate ``--repeats`` times per variant; s/step is the median after ``--warmup`` steps; peak memory
is the summed RSS of each run's process tree every 0.2 s (PSS every second). Method: docs/benchmarks.md.

    python benchmarks/vs_trl.py [--shape 25m|qwen0.5b] [--variant full gc lora ...] [--steps 6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from process_tree import ProcessTree  # noqa: E402 (benchmarks/ is the script's folder)
from trl_side import measured  # noqa: E402
from workloads import local_prefect_server, timing_medians  # noqa: E402

SHAPES = {
    "25m": {"model": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                      "num_key_value_heads": 2}, "response_length": 32, "prompts": 8, "samples": 8},
    "qwen0.5b": {"model": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                           "num_attention_heads": 14, "num_key_value_heads": 2},
                 "response_length": 16, "prompts": 4, "samples": 8},
}  # fmt: skip
DIGITS = 8  # prompts of 8 digits and ">": 9 tokens, every prompt the same length on both sides
LORA = {"lora_rank": 16, "lora_alpha": 32, "target_modules": "all-linear"}
LORA_KEYS = [f"actor_rollout_ref.model.{key}={value}" for key, value in LORA.items()]
PADDED_KEYS = ["actor_rollout_ref.model.use_remove_padding=false"]  # padded rows (the preset packs, as verl does)
PACKING_KEYS = [
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
]
BF16_BASE_KEYS = ["actor_rollout_ref.model.dtype=bfloat16"]  # the frozen base in bfloat16 (either side: LoRA only)
VARIANTS = {  # gradient checkpointing, LoRA, ppoflow's extra overrides (TRL's GRPOTrainer has no padding-free path)
    "full": {"gc": False, "lora": False, "overrides": []},
    "gc": {"gc": True, "lora": False, "overrides": []},
    "lora": {"gc": False, "lora": True, "overrides": LORA_KEYS},
    "lora_gc": {"gc": True, "lora": True, "overrides": LORA_KEYS},
    "lora_gc_bf16": {"gc": True, "lora": True, "overrides": LORA_KEYS + BF16_BASE_KEYS, "dtype": "bfloat16"},
    "lora_padded": {"gc": False, "lora": True, "overrides": LORA_KEYS + PADDED_KEYS},
    "lora_packed": {"gc": False, "lora": True, "overrides": LORA_KEYS + PACKING_KEYS},
}
PPOFLOW = [str(Path(sys.executable).with_name("ppoflow"))]  # the command line a user runs


def build_model(scratch: Path, shape: str, dtype: str = "float32") -> Path:
    """The shape's random-init Qwen2 with ppoflow's character tokenizer (and its chat template), built once, saved
    in ``dtype``: a variant on a bfloat16 base loads a bfloat16 checkpoint, as Qwen2.5's are published (cast from
    a float32 file, loading alone would peak at both copies)."""
    directory = scratch / (f"{shape}-model" if dtype == "float32" else f"{shape}-model-{dtype}")
    if (directory / "config.json").exists():
        return directory
    import tempfile

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.workers.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tiny:  # the tokenizer ppoflow builds for its demo model
        build_tiny_model(tiny, TinyModelConfig(hidden_size=8, intermediate_size=8, num_attention_heads=1))
        tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = Qwen2Config(
        **SHAPES[shape]["model"], vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)  # the same weights in either dtype
    Qwen2ForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def parameter_count(model_dir: Path) -> int:
    """The model's parameters, counted on the meta device (nothing is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sum(parameter.numel() for parameter in model.parameters())


def write_prompts(scratch: Path, rows: int) -> Path:
    """ppoflow's synthetic copy task as a parquet train file (both sides read it)."""
    from ppoflow.configs.schema import SyntheticDataConfig
    from ppoflow.data.datasets import write_synthetic_dataset

    path = scratch / f"copy{DIGITS}-{rows}.parquet"
    if not path.exists():
        write_synthetic_dataset(
            SyntheticDataConfig(task="copy", digits=DIGITS, train_rows=rows, seed=0), str(path), None
        )
    return path


def bfloat16_instructions() -> str:
    """This CPU's bfloat16 instructions, from /proc/cpuinfo: the default rollout samples in bfloat16, which is the
    faster dtype on AMX and the slower one without it (docs/benchmarks.md, ninth run), so the ratio depends on it."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return "bfloat16 instructions unknown"
    return "bfloat16 instructions: " + (
        ", ".join(flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags) or "none"
    )


def side_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def environment_word(word: str) -> tuple[str, str]:
    """``--env``'s NAME=VALUE as a pair; argparse names the argument when it has no name or no ``=``."""
    name, equals, value = word.partition("=")
    if not name or not equals:
        raise argparse.ArgumentTypeError(f"{word!r} is not NAME=VALUE")
    return name, value


def ppoflow_overrides(args, model_dir: Path, prompts_file: Path, variant: str, run_dir: Path) -> list[str]:
    """``ppoflow train``'s overrides: the default preset's sync GRPO, reshaped to the benchmark's batch."""
    shape = SHAPES[args.shape]
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.build=null",
        f"actor_rollout_ref.model.enable_gradient_checkpointing={str(VARIANTS[variant]['gc'] or args.gc).lower()}",
        f"data.train_files={prompts_file}",
        "data.val_files=null",
        "data.synthetic=null",
        "data.shuffle=false",  # the prompts in file order, as TRL's side takes them: the same batches
        f"data.train_batch_size={shape['prompts']}",
        f"data.max_prompt_length={DIGITS + 1}",
        f"data.max_response_length={args.response_length}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={shape['prompts']}",
        f"actor_rollout_ref.rollout.n={shape['samples']}",
        "actor_rollout_ref.actor.entropy_coeff=0.0",  # TRL's GRPO has no entropy bonus by default
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.optim.betas=[0.9,0.999]",
        f"actor_rollout_ref.actor.resources.num_threads={args.threads}",
        f"actor_rollout_ref.actor.resources.num_cpus={args.threads}",
        f"trainer.total_training_steps={args.warmup + args.steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={run_dir}",
        *VARIANTS[variant]["overrides"],
        *args.override,
    ]


def unknown_keys(overrides: list[str]) -> str | None:
    """What ``ppoflow config`` says when it does not know a key of ``overrides`` (one not landed yet), else None;
    any other rejection ends the benchmark."""
    done = subprocess.run([*PPOFLOW, "config", *overrides], capture_output=True, text=True)
    if done.returncode and "unknown key" not in done.stderr:
        raise SystemExit(f"ppoflow rejects the benchmark's overrides:\n{done.stderr}")
    return done.stderr.strip() if done.returncode else None


def watched(
    what: str, command: list[str], env: dict[str, str], log: Path, others: dict[int, str]
) -> tuple[dict, float]:
    """Run ``command`` to its end, its output in ``log``, sampling the memory of its process tree (as the driver)
    and of ``others`` (pid -> kind): the peak and the seconds from start to exit; a failure names the log."""
    with open(log, "w") as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
        with ProcessTree({process.pid: "driver", **others}) as tree:
            code = process.wait()
        wall = time.perf_counter() - started
    if code:
        last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{what} exited {code}: {last[0]} (all of it: {log})")
    return {**tree.peak, "cpu_s": tree.cpu_s}, wall


def run_ppoflow(args, model_dir: Path, prompts_file: Path, variant: str, run_dir: Path, server_pid: int) -> dict:
    """One ``ppoflow train`` of ``variant`` into ``run_dir``, as :func:`run_trl` measures it (its stages: the
    ``timing_s/*`` medians of metrics.jsonl)."""
    from prefect.settings import PREFECT_API_URL

    from ppoflow.flows.tracking import read_metrics

    env = side_env(args.threads) | {"PREFECT_API_URL": PREFECT_API_URL.value()} | dict(args.env)
    command = [
        *PPOFLOW,
        "train",
        "--config",
        "grpo_tiny",
        *ppoflow_overrides(args, model_dir, prompts_file, variant, run_dir),
    ]
    peak, wall = watched("ppoflow train", command, env, run_dir.with_suffix(".log"), {server_pid: "prefect server"})
    rows = [row for row in read_metrics(str(run_dir)) if row["step"] > args.warmup]
    return {
        "step_s": [row["timing_s/step"] for row in rows],
        "stages": {name: seconds for name, seconds in timing_medians(rows).items() if name != "step"},
        "response_length": statistics.mean(row["response_length/mean"] for row in rows),
        "threads": args.threads,
        "peak": peak,
        "wall_s": wall,
    }


def run_trl(args, model_dir: Path, prompts_file: Path, variant: str, run_dir: Path) -> dict:
    """One TRL run (benchmarks/trl_side.py) of ``variant``: its steps' seconds after the warm-up, its stages,
    mean response tokens, threads and peak memory."""
    run_dir.mkdir(parents=True)
    lora = VARIANTS[variant]["lora"]
    spec = {
        "model": str(model_dir), "train_file": str(prompts_file), "output_dir": str(run_dir), "seed": 0,
        "steps": args.warmup + args.steps, "prompts": SHAPES[args.shape]["prompts"],
        "samples": SHAPES[args.shape]["samples"], "response_length": args.response_length, "lr": args.lr,
        "threads": args.threads, "gradient_checkpointing": VARIANTS[variant]["gc"] or args.gc,
        "lora_rank": LORA["lora_rank"] if lora else 0, "lora_alpha": LORA["lora_alpha"],
        "target_modules": LORA["target_modules"], "dtype": VARIANTS[variant].get("dtype", "float32"),
    }  # fmt: skip
    files = ("spec.json", "result.json")
    (run_dir / files[0]).write_text(json.dumps(spec))
    command = [sys.executable, str(Path(__file__).with_name("trl_side.py")), *(str(run_dir / name) for name in files)]
    peak, wall = watched("the TRL side", command, side_env(args.threads), run_dir.with_suffix(".log"), {})
    return {**measured(json.loads((run_dir / files[1]).read_text()), args.warmup), "peak": peak, "wall_s": wall}


def alternate(args, model_dir: Path, prompts_file: Path, variant: str, server_pid: int) -> dict[str, list[dict]]:
    """ppoflow, TRL, ppoflow, TRL, ... ``--repeats`` times on ``variant``, the load printed around each run."""
    runs: dict[str, list[dict]] = {"ppoflow": [], "trl": []}
    for repeat in range(1, args.repeats + 1):
        for side in runs:
            run_dir = model_dir.parent / "runs" / f"{args.shape}-{variant}-{side}-{repeat}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a leftover ppoflow run dir would resume, not rerun
            before = os.getloadavg()[0]
            if side == "ppoflow":
                result = run_ppoflow(args, model_dir, prompts_file, variant, run_dir, server_pid)
            else:
                result = run_trl(args, model_dir, prompts_file, variant, run_dir)
            print(f"{variant} {side} {repeat}: s/step {statistics.median(result['step_s']):.3f}, peak RSS "
                  f"{gb(result['peak']['rss'])} GB; load {before:.2f} before, {os.getloadavg()[0]:.2f} after",
                  flush=True)  # fmt: skip
            runs[side].append(result)
            for weights in (path for path in run_dir.iterdir() if path.is_dir()):  # the exported policy, checkpoints
                shutil.rmtree(weights)
    return runs


def gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def medians(results: list[dict]) -> dict[str, float]:
    """A side's medians over its runs: each run's median s/step, peak RSS and PSS in GB, mean response tokens."""
    return {
        "s/step": statistics.median(statistics.median(run["step_s"]) for run in results),
        "peak RSS GB": statistics.median(run["peak"]["rss"] for run in results) / 1e9,
        "peak PSS GB": statistics.median(run["peak"]["pss"] for run in results) / 1e9,
        "response tokens": statistics.median(run["response_length"] for run in results),
    }


def side_by_side(ours: dict[str, float], theirs: dict[str, float]) -> str:
    return "; ".join(
        f"{name} {ours[name]:.2f} vs {theirs[name]:.2f} (x{ours[name] / theirs[name]:.2f})" for name in ours
    )


def report(args, runs: dict[str, dict[str, list[dict]]], params: int) -> None:
    """Per variant: each repeat's ratios, both sides' medians, where the time and the memory go; a markdown table."""
    table = ["| shape | variant | ppoflow s/step | TRL s/step | x TRL | ppoflow peak GB | TRL peak GB | x TRL "
             "| response tokens ppoflow / TRL |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for variant, sides in runs.items():
        print(f"\n== {args.shape} ({params / 1e6:.1f}M params), variant {variant}: ppoflow vs TRL")
        for index, (ours, theirs) in enumerate(zip(sides["ppoflow"], sides["trl"]), 1):
            print(f"repeat {index}: {side_by_side(medians([ours]), medians([theirs]))}")
        ours, theirs = medians(sides["ppoflow"]), medians(sides["trl"])
        print(f"medians of {args.repeats}: {side_by_side(ours, theirs)}")
        for side, results in sides.items():
            last = results[-1]
            stages = ", ".join(f"{name} {seconds:.3f}" for name, seconds in last["stages"].items())
            kinds = ", ".join(f"{kind} {gb(rss)}" for kind, rss in last["peak"]["by_kind"].items() if rss)
            worker = last["peak"]["model_worker"]
            nice = f"; of it the model's Ray worker {gb(worker[0])}, at niceness {worker[1]}" if worker else ""
            cpu = ", ".join(
                f"{kind} {seconds:.0f}" for kind, seconds in last["peak"]["cpu_s"].items() if seconds >= 0.5
            )
            print(f"{side}, last run: stage medians s: {stages}\n  RSS GB at the peak: {kinds}{nice}\n"
                  f"  CPU s over the run: {cpu}; {last['threads']} torch threads; "
                  f"{last['wall_s']:.0f} s from start to exit")  # fmt: skip
        step, rss = (ours[name] / theirs[name] for name in ("s/step", "peak RSS GB"))
        table.append(
            f"| {args.shape} | {variant} | {ours['s/step']:.2f} | {theirs['s/step']:.2f} | {step:.2f} "
            f"| {ours['peak RSS GB']:.2f} | {theirs['peak RSS GB']:.2f} | {rss:.2f} "
            f"| {ours['response tokens']:.1f} / {theirs['response tokens']:.1f} |"
        )
    ours = {variant: medians(sides["ppoflow"]) for variant, sides in runs.items()}
    if len(ours) > 1:  # checkpointing's memory saving, packing's speed-up: ppoflow's variants against the first
        first = next(iter(ours))
        ratios = (
            f"{variant} s/step x{row['s/step'] / ours[first]['s/step']:.2f}, "
            f"peak RSS x{row['peak RSS GB'] / ours[first]['peak RSS GB']:.2f}"
            for variant, row in ours.items()
        )
        print(f"\nppoflow's variants against {first}: " + "; ".join(ratios))
    print("\n" + "\n".join(table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="25m")
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=["full"])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per run, after --warmup")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="ppoflow, TRL, ppoflow, TRL, ... per variant")
    parser.add_argument("--response-length", type=int, help="max response tokens (default: the shape's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of either side's model")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--gc", action="store_true", help="gradient checkpointing in every variant")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="a ppoflow key=value added to every ppoflow run (e.g. ray.worker_niceness=15); repeatable",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        type=environment_word,
        help="NAME=VALUE in the environment of every ppoflow run (its Ray workers inherit it), e.g. "
        "MALLOC_MMAP_THRESHOLD_=1048576; repeatable",
    )
    parser.add_argument("--scratch", default="outputs/bench/vs_trl", help="models, prompts and run directories")
    args = parser.parse_args()
    args.response_length = args.response_length or SHAPES[args.shape]["response_length"]
    scratch = Path(args.scratch).resolve()
    (scratch / "runs").mkdir(parents=True, exist_ok=True)
    model_dirs = {
        variant: build_model(scratch, args.shape, VARIANTS[variant].get("dtype", "float32")) for variant in args.variant
    }
    prompts_file = write_prompts(scratch, max(256, 2 * SHAPES[args.shape]["prompts"] * (args.warmup + args.steps)))
    params = parameter_count(model_dirs[args.variant[0]])  # either dtype: the same shapes
    shape = SHAPES[args.shape]
    print(f"{args.shape}: Qwen2 {params / 1e6:.1f}M params at {scratch}; {shape['prompts']} prompts x "
          f"{shape['samples']} samples a step, {args.response_length} response tokens at most; {args.threads} torch "
          f"threads a side; {args.warmup} warm-up + {args.steps} measured steps; {os.cpu_count()} cores, "
          f"{bfloat16_instructions()}")  # fmt: skip
    runs: dict[str, dict[str, list[dict]]] = {}
    with local_prefect_server(str(scratch)) as server_pid:
        for variant in args.variant:
            model_dir = model_dirs[variant]
            problem = unknown_keys(ppoflow_overrides(args, model_dir, prompts_file, variant, scratch / "probe"))
            if problem:
                print(f"variant {variant} waits for its config keys; skipped. ppoflow says:\n  {problem}")
                continue
            try:
                runs[variant] = alternate(args, model_dir, prompts_file, variant, server_pid)
            except RuntimeError as failure:  # one variant's failure leaves the others' figures
                print(f"variant {variant} failed: {failure}")
    report(args, runs, params)


if __name__ == "__main__":
    main()
