"""How a packed micro-batch is laid out: padded rows, all sequences in one row, rows as wide as the longest sequence,
or rows holding each prompt once followed by its group's responses (what ``use_remove_padding`` does under sdpa and
eager attention where it costs less; one row is for flash attention's varlen kernels).

vs_trl.py's random-init ``25m`` Qwen2 runs a forward pass and a backward over a long-tailed batch
(benchmarks/packing.py) in each layout, alternating, ``--repeats`` times, in one process with one thread; reported:
the best CPU seconds of each (the measure that other work on the machine disturbs least), the ratio to the padded
layout, the positions each processes, and the largest difference of its logits from the padded ones.

    python benchmarks/pack_layout.py [--batch 64x32x9 32x256x16 32x16x9x8] [--repeats 2]

A batch is sequences x max response x prompt, and x samples per prompt where prompts repeat (a GRPO group).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from packing import long_tailed_batch  # benchmarks/ is the script's folder
from vs_trl import build_model

LAYOUTS = ("padded", "one row", "rows of the longest", "shared prompts")


def logits_of(model, batch, layout: str):
    """The logits that predict the batch's response tokens, [K, vocab], and the positions the pass processed."""
    from ppoflow.workers.training.learner import sequence_inputs
    from ppoflow.workers.training.packing import pack, prompt_groups, response_positions

    input_ids, kept, position_ids = sequence_inputs(batch)
    positions, prompt = response_positions(batch), batch["prompts"].shape[1]
    if layout == "padded":
        logits = model(
            input_ids=input_ids, attention_mask=kept.long(), position_ids=position_ids, use_cache=False
        ).logits
        return logits[:, prompt - 1 : prompt + positions.shape[1] - 1][positions], input_ids.numel()
    in_rows, groups = layout != "one row", prompt_groups(batch) if layout == "shared prompts" else None
    ids, packed_positions, index, mask = pack(
        input_ids, kept, position_ids, prompt, positions, in_rows=in_rows, groups=groups
    )
    logits = model(  # no cache: transformers then reads the packing from the position ids
        input_ids=ids, position_ids=packed_positions, attention_mask=mask, use_cache=False
    ).logits
    return logits.flatten(0, 1)[index], ids.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--batch",
        nargs="+",
        default=["64x32x9", "32x256x16", "32x16x9x8"],
        help="sequences x max response x prompt [x samples per prompt]",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scratch", default=str(Path(tempfile.gettempdir()) / "ppoflow-bench-packing"))
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(build_model(Path(args.scratch), "25m"), dtype=torch.float32)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores, 1 thread; 25m Qwen2; forward + backward; "
          f"best CPU seconds of {args.repeats}")  # fmt: skip
    print("| batch | layout | positions | CPU s | x padded | max abs logit diff |\n|---|---|---|---|---|---|")
    for spec in args.batch:
        sequences, max_response, prompt, samples = (int(part) for part in f"{spec}x1".split("x")[:4])
        batch = long_tailed_batch(sequences, max_response, prompt=prompt, samples=samples)
        best, padded_logits = {}, None
        for _ in range(args.repeats):
            for layout in LAYOUTS:
                model.zero_grad(set_to_none=True)
                started = time.process_time()
                logits, processed = logits_of(model, batch, layout)
                logits.logsumexp(dim=-1).mean().backward()
                seconds = time.process_time() - started
                padded_logits = logits.detach() if layout == "padded" else padded_logits
                difference = float((logits.detach() - padded_logits).abs().max())
                best[layout] = min(best.get(layout, (seconds,))[0], seconds), processed, difference
        for layout, (seconds, processed, difference) in best.items():
            print(f"| {spec} | {layout} | {processed} | {seconds:.2f} | {seconds / best['padded'][0]:.2f} "
                  f"| {difference:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
