"""What one ``weight_sync`` moves with LoRA: the adapter's tensors (the transformers rollout) or the merged full
weights (vLLM, the rollout service's replicas), against full fine-tuning's whole state dict.

Bytes are exact (the update's layout); the times are the actor's ``prepare_weights`` plus the rollout's
``apply_weights``, in one process (no Ray: the object store's copy is left out), median of ``--repeats``. Models:
the demo's tiny Llama and benchmarks/vs_trl.py's 25M Qwen2, both random-init.

    python benchmarks/lora_sync.py [--repeats 5] [--rank 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from vs_trl import build_model  # noqa: E402 (benchmarks/ is the script's folder)

VARIANTS = {  # what the actor sends, and the overrides that make it so
    "full fine-tuning": [],
    "LoRA, adapter only (hf rollout)": ["lora"],
    "LoRA, merged (vLLM, replicas)": ["lora", "actor_rollout_ref.rollout.mode=async"],
}


def measure(cfg, repeats: int) -> tuple[int, float]:
    """Bytes of one update and the median seconds of prepare + apply."""
    from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
    from ppoflow.workers.training.policy import ActorWorker

    actor, rollout = ActorWorker(cfg), HFRolloutWorker(cfg)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        update = actor.prepare_weights()
        rollout.apply_weights(update)
        times.append(time.perf_counter() - start)
    return update.nbytes, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    from ppoflow.configs import load_config
    from ppoflow.workers.models import ensure_model

    lora = [f"actor_rollout_ref.model.lora_rank={args.rank}", f"actor_rollout_ref.model.lora_alpha={2 * args.rank}"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        models = {
            "tiny Llama (332k)": [
                f"actor_rollout_ref.model.path={scratch}/tiny",
                "actor_rollout_ref.model.build.seed=0",
            ],
            "Qwen2 25M": [f"actor_rollout_ref.model.path={build_model(Path(scratch), '25m')}"],
        }
        for model, model_overrides in models.items():
            base = [*model_overrides, f"data.train_files={scratch}/train.parquet", "data.val_files=null"]
            base += ["trainer.test_freq=-1", "actor_rollout_ref.hybrid_engine=false"]
            full_bytes = None
            for variant, words in VARIANTS.items():
                overrides = base + [word for word in words if word != "lora"] + (lora if "lora" in words else [])
                cfg = load_config("grpo_tiny", overrides)
                ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
                nbytes, seconds = measure(cfg, args.repeats)
                full_bytes = full_bytes or nbytes
                rows.append((model, variant, nbytes, nbytes / full_bytes, seconds))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; LoRA rank {args.rank}, all-linear")
    print("| model | sync | bytes | x full | prepare + apply ms |\n|---|---|---|---|---|")
    for model, variant, nbytes, share, seconds in rows:
        print(f"| {model} | {variant} | {nbytes:,} | {share:.3f} | {seconds * 1000:.1f} |")


if __name__ == "__main__":
    main()
