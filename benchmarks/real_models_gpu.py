"""The real-models check on one GPU: the actor in process (no Ray, no Prefect), its plain path against gradient
checkpointing, padding-free token-budget micro-batches, LoRA and bf16 mixed precision.

A random-init Qwen2 with Qwen2.5-0.5B's shapes and vocabulary takes a long-tailed batch (benchmarks/packing.py)
whose prompts each serve ``--samples`` sequences, as a GRPO group's do (packing then shares them under sdpa);
each setting is a fresh ``ActorWorker`` that computes the log-probs, updates once and computes them again. Its
log-probs, entropy and grad norm are checked against the plain path's (LoRA's against LoRA on the plain path)
within the tolerances printed beside them; reported per pass: peak ``torch.cuda.max_memory_allocated``, tokens/s.
Method and figures: docs/benchmarks.md#on-a-gpu.

    python benchmarks/real_models_gpu.py [--sequences 64] [--samples 8] [--max-response 2048] [--micro 4]
        [--budget 16384]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from packing import long_tailed_batch  # benchmarks/ is the script's folder

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip
PROMPT = 128
LORA = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"]
CHECKPOINTING = ["actor_rollout_ref.model.enable_gradient_checkpointing=true"]
PACKED = [
    "actor_rollout_ref.model.use_remove_padding=true",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
]
BF16 = ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bfloat16"]
SETTINGS = {  # name: (overrides, the setting it is compared with, tolerances)
    "plain": ([], None, None),
    "checkpointing": (CHECKPOINTING, "plain", "exact"),
    "remove_padding": (PACKED, "plain", "kernels"),
    "bf16": (BF16, "plain", "bf16"),
    "lora": (LORA, "plain", "lora"),
    "lora+checkpointing+remove_padding": (LORA + CHECKPOINTING + PACKED, "lora", "kernels"),
    "bf16+remove_padding": (BF16 + PACKED, "remove_padding", "bf16"),
    "all, bf16": (CHECKPOINTING + PACKED + BF16, "bf16+remove_padding", "bf16"),
}
# Largest |log-prob difference| before and after the update, and relative differences of entropy and grad norm.
# exact: the same kernels on the same inputs; kernels: another attention layout (packed, no padding), float32;
# bf16: bf16 compute against float32; lora: a fresh adapter changes nothing before the update, and trains
# other weights (only the log-probs before the update and the entropy are compared).
TOLERANCES = {
    "exact": {"log_prob_before": 1e-4, "log_prob_after": 2e-3, "entropy": 1e-5, "grad_norm": 1e-4},
    "kernels": {"log_prob_before": 2e-3, "log_prob_after": 5e-3, "entropy": 1e-4, "grad_norm": 1e-3},
    "bf16": {"log_prob_before": 0.5, "log_prob_after": 0.5, "entropy": 1e-2, "grad_norm": 5e-2},
    "lora": {"log_prob_before": 1e-4, "entropy": 1e-5},
}


def build_model(scratch: Path, layers: int, vocab: int) -> Path:
    """The random-init Qwen2 (float32) with ``layers`` of Qwen2.5-0.5B's layers and a ``vocab``-token head."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = scratch / f"qwen0.5b-{layers}-{vocab}"
    if not (directory / "config.json").exists():
        config = Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers, "vocab_size": vocab},
                             max_position_embeddings=32768, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def overrides(args, model_dir: Path, setting: list[str]) -> list[str]:
    rows = args.sequences // 2
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "actor_rollout_ref.model.use_remove_padding=false",
        f"data.train_batch_size={rows}",
        "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
        f"data.max_prompt_length={PROMPT}",
        f"data.max_response_length={args.max_response}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={args.budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={args.budget}",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.resources.num_gpus={int(args.device == 'cuda')}",
        f"trainer.n_gpus_per_node={int(args.device == 'cuda')}",
        *setting,
    ]


class Pass:
    """Times a pass and reads its peak allocated memory (CUDA; on the CPU, seconds only)."""

    def __init__(self, torch, tokens: int):
        self.torch, self.tokens, self.cuda = torch, tokens, torch.cuda.is_available()

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.started
        self.peak_gb = self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else float("nan")

    def row(self) -> dict[str, float]:
        return {"s": self.seconds, "tokens_per_s": self.tokens / self.seconds, "peak_gb": self.peak_gb}


def run_setting(args, model_dir: Path, setting: list[str]) -> dict:
    """A fresh actor with the setting: log-probs, one update, log-probs again; its figures and outputs."""
    import torch

    from ppoflow.configs import load_config
    from ppoflow.workers.training.packing import sequence_lengths
    from ppoflow.workers.training.policy import ActorWorker

    if (
        torch.cuda.is_available()
    ):  # as in a fresh worker process: every SDPA backend on, unless the worker turns one off
        torch.backends.cuda.enable_cudnn_sdp(not args.no_cudnn_attention)
    actor = ActorWorker(load_config("grpo_tiny", overrides(args, model_dir, setting)))
    weights_gb = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    batch = long_tailed_batch(args.sequences, args.max_response, prompt=PROMPT, vocab=args.vocab, samples=args.samples)
    tokens = sum(sequence_lengths(batch))
    actor.compute_log_prob(batch[:2])  # warm-up: the first pass's one-time costs (kernels, allocator)
    with Pass(torch, tokens) as log_prob:
        before = actor.compute_log_prob(batch)["log_probs"]
    batch["old_log_probs"] = before
    with Pass(torch, tokens) as update:
        metrics = actor.update(batch, step=1).metrics
    after = actor.compute_log_prob(batch)["log_probs"]
    attention = actor.model.config._attn_implementation
    del actor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "figures": {
            "weights_gb": weights_gb,
            "log_prob": log_prob.row(),
            "update": update.row(),
            "tokens": tokens,
            "attention": attention,
        },  # fmt: skip
        "before": before,
        "after": after,
        "mask": batch["response_mask"],
        "entropy": metrics["actor/entropy"],
        "grad_norm": metrics["actor/grad_norm"],
    }


def differences(run: dict, baseline: dict) -> dict[str, float]:
    """Largest log-prob differences over the response tokens, relative entropy and grad-norm differences."""
    mask = run["mask"]
    relative = lambda name: abs(run[name] - baseline[name]) / max(abs(baseline[name]), 1e-12)  # noqa: E731
    return {
        "log_prob_before": float((run["before"] - baseline["before"])[mask].abs().max()),
        "log_prob_after": float((run["after"] - baseline["after"])[mask].abs().max()),
        "entropy": relative("entropy"),
        "grad_norm": relative("grad_norm"),
        "update_moved": float((run["after"] - run["before"])[mask].abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-response", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=8, help="consecutive sequences per prompt (a GRPO group)")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"])
    parser.add_argument("--vocab", type=int, default=QWEN25_05B["vocab_size"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--scratch", default="/tmp/ppoflow-real-models-gpu")
    parser.add_argument("--no-cudnn-attention", action="store_true", help="keep SDPA off its cuDNN backend")
    parser.add_argument("--json", help="also write the figures and differences to this file")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu (small --layers and --vocab) to try the script")
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model_dir = build_model(Path(args.scratch), args.layers, args.vocab)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(f"{device}; torch {torch.__version__}; Qwen2 {args.layers} layers x hidden 896, vocab {args.vocab}; "
          f"{args.sequences} sequences, {args.samples} per prompt of 4-{PROMPT} tokens, responses 8-"
          f"{args.max_response}; padded micro-batches of {args.micro} rows, token budget {args.budget}",
          flush=True)  # fmt: skip
    runs, report, failures = {}, {}, []
    for name in args.settings:
        setting, compared_with, tolerance = SETTINGS[name]
        started = time.perf_counter()
        try:
            runs[name] = run_setting(args, model_dir, setting)
        except Exception as error:  # one setting's failure is reported; the others still run
            failures.append(f"{name}: {type(error).__name__}: {error}")
            print(f"{name}: FAILED: {failures[-1]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            continue
        report[name] = dict(runs[name]["figures"])
        if compared_with in runs:
            diff = differences(runs[name], runs[compared_with])
            limits = TOLERANCES[tolerance]
            bad = [key for key, limit in limits.items() if not diff[key] <= limit]
            failures += [f"{name}: {key} {diff[key]:.3g} > {limits[key]:g}" for key in bad]
            report[name].update(compared_with=compared_with, differences=diff, tolerances=limits)
        print(f"{name} ({time.perf_counter() - started:.0f} s): {json.dumps(report[name])}", flush=True)
    print(
        "\n| setting | log-prob pass: peak GB, tokens/s | update: peak GB, tokens/s | compared with | "
        "max abs log-prob diff before / after update (tolerance) | rel. diff entropy, grad norm |"
    )
    print("|---|---|---|---|---|---|")
    for name, row in report.items():
        diff, limits = row.get("differences"), row.get("tolerances", {})
        compared = "-" if diff is None else (
            f"{row['compared_with']} | {diff['log_prob_before']:.2g} / {diff['log_prob_after']:.2g} "
            f"({limits['log_prob_before']:g} / {limits.get('log_prob_after', '-')}) | {diff['entropy']:.2g}, "
            f"{diff['grad_norm']:.2g}"
        )  # fmt: skip
        if diff is None:
            compared = "- | - | -"
        print(f"| {name} | {row['log_prob']['peak_gb']:.1f}, {row['log_prob']['tokens_per_s']:.0f} | "
              f"{row['update']['peak_gb']:.1f}, {row['update']['tokens_per_s']:.0f} | {compared} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print("\nREAL MODELS GPU CHECK:", "FAIL\n  " + "\n  ".join(failures) if failures else "PASS")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
