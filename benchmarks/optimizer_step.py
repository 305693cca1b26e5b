"""One AdamW step of the learner's optimizer: the per-tensor loop (torch's default on a CPU) against the fused kernel
(what the learner uses unsharded, and transformers' Trainer, so TRL, by default).

The parameters are those of vs_trl.py's random-init Qwen2 shapes (``25m``, ``qwen0.5b``) with random gradients; each
setting steps ``--repeats`` times after one warm-up step; reported: the best CPU seconds of the process (the
measure that other work on the machine disturbs least), the ratio, the threads and the load average.

    python benchmarks/optimizer_step.py [--shape 25m qwen0.5b] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

from vs_trl import SHAPES  # benchmarks/ is the script's folder


def step_seconds(shape: str, fused: bool, repeats: int) -> float:
    """The best CPU seconds of one AdamW step over the shape's parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape]["model"], vocab_size=32, tie_word_embeddings=True)
    parameters = list(Qwen2ForCausalLM(config).parameters())
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer = torch.optim.AdamW(parameters, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, fused=fused)
    optimizer.step()  # the warm-up: the state is allocated here
    seconds = []
    for _ in range(repeats):
        started = time.process_time()
        optimizer.step()
        seconds.append(time.process_time() - started)
    return min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores, {args.threads} thread(s); "
          f"best CPU seconds of {args.repeats} steps")  # fmt: skip
    print("| shape | per-tensor loop s | fused s | fused x loop |\n|---|---|---|---|")
    for shape in args.shape:
        loop, fused = step_seconds(shape, False, args.repeats), step_seconds(shape, True, args.repeats)
        print(f"| {shape} | {loop:.3f} | {fused:.3f} | {fused / loop:.2f} |")


if __name__ == "__main__":
    main()
