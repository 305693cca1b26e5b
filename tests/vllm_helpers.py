"""Shared by tests/test_vllm_rollout*.py: the overrides that select vLLM on one GPU, and a prompt batch of a config."""

from __future__ import annotations

from ppoflow.workers.models import load_tokenizer

GPU_OVERRIDES = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.resources.num_gpus=1",
    "rollout.n_gpus_per_node=1",
]


def prompt_batch(cfg, count: int):
    """The first ``count`` train prompts of ``cfg`` as a rollout input (``prompts``, ``prompt_mask``)."""
    from ppoflow.data.datasets import ensure_datasets, load_prompt_dataset

    ensure_datasets(cfg.data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
    rows = list(range(count))
    return dataset.batch(rows, [f"u{row}" for row in rows], tokenizer.pad_token_id).exclude(
        "uid", "data_source", "ground_truth"
    )
