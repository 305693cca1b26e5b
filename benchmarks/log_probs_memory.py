"""Peak memory of the per-token log-probs and entropy over a real vocabulary: the fused chunked pass
(``algorithms/losses.py`` ``log_probs_and_entropy``) against the unfused log-softmax and softmax.

``--tokens`` rows of ``--vocab`` random float32 logits (Qwen2.5's 151,936 by default) go through the log-probs of
random labels and the entropy, then a backward of a weighted sum of both, each way in a fresh process; reported:
the peak resident memory above the logits and their gradient's share (``2 x tokens x vocab x 4`` bytes), its
ratio to the unfused way's, and the load average. Figures: docs/benchmarks.md#on-a-gpu.

    python benchmarks/log_probs_memory.py [--tokens 2048] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def measure(tokens: int, vocab: int, fused: bool) -> float:
    """In this (fresh) process: MiB of peak RSS above the logits and their gradient."""
    import resource

    import torch

    from ppoflow.algorithms.losses import log_probs_and_entropy

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=generator).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    logits.grad = torch.zeros_like(logits)  # the gradient's memory is counted as the logits' share
    with open("/proc/self/statm") as statm:
        held = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    if fused:
        log_probs, entropy = log_probs_and_entropy(logits, labels)
    else:
        log_softmax = torch.log_softmax(logits, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
    (log_probs.sum() - 0.01 * entropy.sum()).backward()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - held) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--child", choices=["fused", "unfused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.tokens, args.vocab, args.child == "fused")))
        return
    above = {}
    for way in ("unfused", "fused"):
        words = ["--tokens", str(args.tokens), "--vocab", str(args.vocab), "--child", way]
        done = subprocess.run([sys.executable, __file__, *words], capture_output=True, text=True, check=True)
        above[way] = json.loads(done.stdout.strip().splitlines()[-1])
    share = 2 * args.tokens * args.vocab * 4 / 2**20
    print(f"load average {os.getloadavg()[0]:.2f}; {args.tokens} tokens x {args.vocab} vocabulary, float32; the "
          f"logits and their gradient: {share:.0f} MiB")  # fmt: skip
    print("| way | peak MiB above the logits and their gradient | x unfused |\n|---|---|---|")
    for way, mib in above.items():
        print(f"| {way} | {mib:.0f} | {mib / above['unfused']:.2f} |")


if __name__ == "__main__":
    main()
