"""Generation speed of the transformers engine: ppoflow's ``sample_responses`` against ``model.generate``
called directly, on the same model and prompts, in one process.

Variants: ``model.generate`` (dynamic KV cache; the baseline), without the cache, with the static cache, with the
static cache and a ``torch.compile``d decode step (forced on the CPU too), and ppoflow's ``sample_responses`` (the
same call plus a logits processor that keeps each sampled token's log-prob). Reported: generated tokens/s (up to
and including EOS) and the ratio to the baseline. Method and figures: docs/benchmarks.md#generation-speed.

    python benchmarks/generation.py [--repeats 9] [--workload demo|larger]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from workloads import WORKLOADS, built_in  # noqa: E402 (benchmarks/ is the script's folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--workload", choices=list(WORKLOADS), default="larger")
    args = parser.parse_args()

    import torch
    from transformers import CompileConfig

    from ppoflow.configs import load_config
    from ppoflow.data.datasets import ensure_datasets, load_prompt_dataset
    from ppoflow.workers.models import ensure_model, load_causal_lm, load_tokenizer, set_up_worker_process
    from ppoflow.workers.rollout.sampling import SamplingParams, sample_responses

    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(
            "grpo_tiny", WORKLOADS[args.workload] + built_in(scratch, args.workload) + ["trainer.test_freq=-1"]
        )
        set_up_worker_process(cfg.actor_rollout_ref.rollout.resources)
        ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
        ensure_datasets(cfg.data)
        tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
        model = load_causal_lm(cfg.actor_rollout_ref.model).eval()
        dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
        rows = list(range(cfg.data.train_batch_size))
        prompts = dataset.batch(rows, [str(row) for row in rows], tokenizer.pad_token_id)
        sampling = SamplingParams.for_training(cfg)
        input_ids = prompts["prompts"].repeat_interleave(sampling.n, dim=0)
        attention_mask = prompts["prompt_mask"].repeat_interleave(sampling.n, dim=0).long()
        eos = tokenizer.eos_token_id

        def direct(**options) -> int:
            with torch.no_grad():
                sequences = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    do_sample=True,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=max(sampling.top_k, 0),
                    max_new_tokens=sampling.max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                    **options,
                )
            responses = sequences[:, input_ids.shape[1] :]
            is_eos = responses == eos
            return int(((is_eos.cumsum(dim=1) - is_eos.long()) == 0).sum())

        def ours() -> int:
            batch = sample_responses(
                model, tokenizer, prompts, step=1, sampling=sampling, weight_version=0, device=torch.device("cpu")
            )
            return int(batch["response_mask"].sum())

        compiled = CompileConfig(mode="default")  # reduce-overhead (the default) is CUDA graphs
        compiled._compile_all_devices = True  # transformers' switch to compile on a CPU too
        variants = {
            "generate": lambda: direct(),
            "generate, no cache": lambda: direct(use_cache=False),
            "generate, static": lambda: direct(cache_implementation="static"),
            "generate, compiled": lambda: direct(cache_implementation="static", compile_config=compiled),
            "ppoflow": ours,
        }
        for run in variants.values():
            run()  # warm-up (and the compilation)
        measured: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):  # round-robin, so that no variant gets a quieter moment of the machine
            for name, run in variants.items():
                torch.manual_seed(0)
                start = time.perf_counter()
                tokens = run()
                measured[name].append(tokens / (time.perf_counter() - start))
        rates = {name: statistics.median(values) for name, values in measured.items()}
    baseline = rates["generate"]
    print(
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; workload {args.workload}: "
        f"{len(rows)} prompts x {sampling.n} samples, up to {sampling.max_new_tokens} tokens; median of {args.repeats}"
    )
    print("| variant | tokens/s | x generate |\n|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / baseline:.2f} |")
    print(json.dumps(rates))


if __name__ == "__main__":
    main()
