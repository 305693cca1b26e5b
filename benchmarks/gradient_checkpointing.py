"""Peak memory and time of a training forward and backward pass with and without gradient checkpointing.

A random-init Qwen2 with Qwen2.5-0.5B's layer shapes (hidden 896, MLP 4864, 14 heads, 2 KV heads, its vocabulary;
``--layers`` of its 24) runs the actor's forward (``response_logits``) and a backward on ``--batch`` sequences of
``--length`` tokens, each setting in a fresh process, alternating ``--repeats`` times. Reported: the peak resident
memory above what the model and its gradients hold (the activations kept for the backward pass), the pass's time,
their ratios to the plain pass, and the load. Method and figures: docs/benchmarks.md#gradient-checkpointing.

    python benchmarks/gradient_checkpointing.py [--layers 8] [--length 1024] [--batch 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
              "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip


def measure(layers: int, length: int, batch: int, checkpointing: bool) -> dict[str, float]:
    """In this (fresh) process: the model, then one forward and backward; MiB above the model, and seconds."""
    import resource
    import time

    import torch
    from tensordict import TensorDict
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ppoflow.workers.models import with_gradient_checkpointing
    from ppoflow.workers.training.learner import response_logits

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, num_hidden_layers=layers, max_position_embeddings=length))
    model = with_gradient_checkpointing(model, checkpointing).train()
    for parameter in model.parameters():  # the gradients' memory belongs to the model's share, not the pass's
        parameter.grad = torch.zeros_like(parameter)
    prompt = length // 4
    ids = torch.randint(0, QWEN25_05B["vocab_size"], (batch, length))
    masks = {"prompt_mask": torch.ones(batch, prompt, dtype=torch.bool),
             "response_mask": torch.ones(batch, length - prompt, dtype=torch.bool)}  # fmt: skip
    micro = TensorDict({"prompts": ids[:, :prompt], "responses": ids[:, prompt:], **masks}, batch_size=[batch])
    with open("/proc/self/statm") as statm:
        held = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    started = time.perf_counter()
    response_logits(model, micro).float().logsumexp(-1).mean().backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"above_model_mib": (peak - held) / 2**20, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["plain", "checkpointed"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.layers, args.length, args.batch, args.child == "checkpointed")))
        return
    runs: dict[str, list[dict]] = {"plain": [], "checkpointed": []}
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1), "TRANSFORMERS_VERBOSITY": "error"}
    for _ in range(args.repeats):
        for setting in runs:
            words = ["--layers", str(args.layers), "--length", str(args.length), "--batch", str(args.batch)]
            done = subprocess.run([sys.executable, __file__, *words, "--child", setting], capture_output=True,
                                  text=True, check=True, env=env)  # fmt: skip
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = {setting: {name: min(run[name] for run in rows) for name in rows[0]} for setting, rows in runs.items()}
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; Qwen2.5-0.5B layer shapes, "
          f"{args.layers} layers, {args.batch} x {args.length} tokens; best of {args.repeats}")  # fmt: skip
    print("| | MiB above the model | x plain | forward + backward s | x plain |\n|---|---|---|---|---|")
    for setting, row in best.items():
        memory, seconds = row["above_model_mib"], row["seconds"]
        print(f"| {setting} | {memory:.0f} | {memory / best['plain']['above_model_mib']:.2f} | {seconds:.2f} "
              f"| {seconds / best['plain']['seconds']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
