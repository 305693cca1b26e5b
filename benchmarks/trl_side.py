"""The TRL side of benchmarks/vs_trl.py: one GRPOTrainer run in this (fresh) process, on the model directory,
prompts and reward the ppoflow side uses, from a JSON spec the benchmark writes; the result is a JSON file.

Each step's end (a TrainerCallback's timestamp), the seconds each step spent generating (``_generate``),
scoring (``_calculate_rewards``) and in all of the batch's preparation (``_generate_and_score_completions``:
generation, scoring, advantages), and TRL's own logged mean completion length. The trained policy is saved at
the end, as ``ppoflow train`` exports its own.

    python benchmarks/trl_side.py SPEC.json RESULT.json    (run by vs_trl.py, not by hand)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

STAGES = {"gen": "generate", "reward": "reward", "prepare (gen+reward+adv)": "prepare"}


def run(spec: dict) -> dict:
    """GRPO with TRL as ``spec`` says (written by :func:`vs_trl.run_trl`); the timings and lengths it measured."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ppoflow.algorithms.scoring import score_responses, solution_text

    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    rows = pq.read_table(spec["train_file"]).to_pylist()
    # ppoflow's chat template concatenates the messages' contents: the same prompt tokens as a plain string
    dataset = Dataset.from_list(
        [
            {
                "prompt": "".join(message["content"] for message in row["prompt"]),
                "ground_truth": row["reward_model"]["ground_truth"],
                "data_source": row["data_source"],
            }
            for row in rows
        ]
    )

    def copy_reward(prompts, completions, completion_ids, ground_truth, data_source, **_) -> list[float]:
        """ppoflow's scorers on the response tokens as ppoflow's reward stage decodes them."""
        solutions = [solution_text(ids, tokenizer) for ids in completion_ids]
        return score_responses(data_source, solutions, ground_truth)[0]

    timings: dict[str, list[float]] = {"generate": [], "reward": [], "prepare": []}

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer, timing the pieces of a step's batch preparation."""

        def _timed(self, name: str, method, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                timings[name].append(time.perf_counter() - start)

        def _generate(self, prompts):
            return self._timed("generate", super()._generate, prompts)

        def _calculate_rewards(self, *args, **kwargs):
            return self._timed("reward", super()._calculate_rewards, *args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            return self._timed("prepare", super()._generate_and_score_completions, inputs)

    step_ends: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())  # step 1 is timed from here

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    peft_config = None
    if spec["lora_rank"]:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=spec["lora_rank"], lora_alpha=spec["lora_alpha"], target_modules=spec["target_modules"],
            task_type="CAUSAL_LM",
        )  # fmt: skip
    args = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, bf16=False, report_to="none", disable_tqdm=True,
        save_strategy="no", logging_steps=1, seed=spec["seed"], model_init_kwargs={"dtype": spec["dtype"]},
        max_steps=spec["steps"], per_device_train_batch_size=spec["prompts"] * spec["samples"],
        gradient_accumulation_steps=1, num_generations=spec["samples"], max_completion_length=spec["response_length"],
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2, loss_type="dapo", learning_rate=spec["lr"],
        lr_scheduler_type="constant", adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, max_grad_norm=1.0,
        gradient_checkpointing=spec["gradient_checkpointing"], shuffle_dataset=False,
    )  # fmt: skip
    trainer = TimedGRPOTrainer(
        model=spec["model"], reward_funcs=copy_reward, args=args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[Clock()], peft_config=peft_config,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(f"{spec['output_dir']}/final")  # as ppoflow train writes the trained policy at the end
    return {
        "step_s": [end - start for start, end in zip(step_ends, step_ends[1:])],
        **{f"{name}_s": values for name, values in timings.items()},
        "response_length": lengths,
        "threads": torch.get_num_threads(),
    }


def measured(result: dict, warmup: int) -> dict:
    """A result's steps after ``warmup``: their seconds, stage medians (the update: a step less its preparation),
    mean completion tokens, and the threads the run used."""
    after = slice(warmup, None)
    step_s = result["step_s"][after]
    stages = {name: statistics.median(result[f"{key}_s"][after]) for name, key in STAGES.items()}
    stages["update (step - prepare)"] = statistics.median(
        step - prepare for step, prepare in zip(step_s, result["prepare_s"][after])
    )
    return {
        "step_s": step_s,
        "stages": stages,
        "response_length": statistics.mean(result["response_length"][after]),
        "threads": result["threads"],
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        result = run(json.load(handle))
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
