"""Where a sync step's memory goes: the colocated actor in one process (no Ray, no Prefect) at vs_trl.py's shapes.

``ColocatedActorWorker`` with vs_trl.py's overrides for ``--variant`` generates for the shape's prompts (random
copy-task digits), updates on random advantages, ``--steps`` times, then writes its Hugging Face export, as the
last act of a run does. A thread reads the process's RSS every 2 ms; reported: each step's generation and
update seconds with the peak RSS of each and the RSS before the update, the RSS just before and the peak during
the first optimizer step (where AdamW's moments appear), and the export's seconds and peak RSS. The load average
is printed. Figures: docs/benchmarks.md, "Side by side with TRL", fifth and tenth runs.

    python benchmarks/actor_memory.py [--shape qwen0.5b] [--variant gc] [--steps 3] [--override key=value ...]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from vs_trl import SHAPES, VARIANTS, build_model, ppoflow_overrides, write_prompts  # benchmarks/ is its folder


class PeakRSS:
    """The process's peak RSS since :meth:`reset`, read every 2 ms by a daemon thread."""

    def __init__(self):
        import psutil

        self.process, self.peak = psutil.Process(), 0
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def now(self) -> float:
        return self.process.memory_info().rss / 1e9

    def reset(self) -> None:
        self.peak = 0

    def gb(self) -> float:
        return max(self.peak, self.process.memory_info().rss) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen0.5b")
    parser.add_argument("--variant", choices=VARIANTS, default="gc")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--override", nargs="*", default=[], help="more ppoflow overrides, key=value")
    parser.add_argument("--scratch", default="outputs/bench/vs_trl", help="vs_trl.py's models and prompts")
    args = parser.parse_args()
    import torch
    from tensordict import TensorDict

    from ppoflow.configs import load_config
    from ppoflow.workers.rollout.sampling import SamplingParams
    from ppoflow.workers.training.colocated import ColocatedActorWorker

    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    settings = argparse.Namespace(  # what ppoflow_overrides reads of vs_trl.py's arguments
        shape=args.shape, gc=False, response_length=shape["response_length"], lr=1e-5, threads=args.threads,
        warmup=0, steps=args.steps, override=args.override,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        words = ppoflow_overrides(
            settings,
            build_model(scratch, args.shape, VARIANTS[args.variant].get("dtype", "float32")),
            write_prompts(scratch, 256),
            args.variant,
            Path(run_dir),
        )
        cfg = load_config("grpo_tiny", words)
        torch.set_num_threads(args.threads)
        rss = PeakRSS()
        actor = ColocatedActorWorker(cfg)
        print(f"{args.shape} {args.variant} {' '.join(args.override)}; {args.threads} threads; load average "
              f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; loaded: RSS {rss.now():.2f} GB",
              flush=True)  # fmt: skip
        optimizer_step = actor.learner.optimizer.step

        def watched_step(*step_args, **step_kwargs):  # the first step allocates AdamW's moments
            before = rss.now()
            rss.reset()
            result = optimizer_step(*step_args, **step_kwargs)
            print(f"  optimizer step: RSS {before:.2f} GB before, peak {rss.gb():.2f} GB", flush=True)
            actor.learner.optimizer.step = optimizer_step
            return result

        actor.learner.optimizer.step = watched_step
        generator = torch.Generator().manual_seed(0)
        for step in range(1, args.steps + 1):
            digits = torch.randint(3, 13, (shape["prompts"], 9), generator=generator)
            prompts = TensorDict(
                {"prompts": digits, "prompt_mask": torch.ones_like(digits, dtype=torch.bool)},
                batch_size=[shape["prompts"]],
            )
            rss.reset()
            started = time.perf_counter()
            batch = actor.generate(prompts, step=step, sampling=SamplingParams.for_training(cfg))
            generated, generation_peak = time.perf_counter(), rss.gb()
            batch["advantages"] = torch.randn(batch["responses"].shape, generator=generator) * batch["response_mask"]
            before_update = rss.now()
            rss.reset()
            actor.update(batch, step=step)
            print(f"step {step}: generation {generated - started:.2f} s, peak {generation_peak:.2f} GB; update "
                  f"{time.perf_counter() - generated:.2f} s, RSS {before_update:.2f} GB before, peak {rss.gb():.2f} GB",
                  flush=True)  # fmt: skip
        rss.reset()
        started = time.perf_counter()
        actor.save_pretrained(str(Path(run_dir) / "huggingface"))
        print(f"export: {time.perf_counter() - started:.2f} s, peak {rss.gb():.2f} GB", flush=True)


if __name__ == "__main__":
    main()
