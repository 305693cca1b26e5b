"""The ``data`` section: prompt files, and the built-in synthetic tasks that write them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ppoflow.configs.schema_base import Section, Seed


class SyntheticDataConfig(Section):
    """Built-in synthetic task; when set, missing ``train_files``/``val_files`` are generated from it
    (see ``DataConfig.synthetic`` for when a preset's task applies)."""

    task: Literal["copy", "vault", "prefer"] = Field(
        "copy",
        description="Synthetic task: `copy` = repeat the prompt's digits, then stop; `vault` = answer the "
        "code the prompt's key opens, which the `vault` tool tells (see ppoflow.data.vault); `prefer` = no rule, "
        "no answer: a reward model scores it (docs/reward_models.md).",
    )
    digits: int = Field(2, ge=1, le=8, description="Digits per prompt.")
    train_rows: int = Field(3200, ge=1, description="Rows written to the train file.")
    val_rows: int = Field(100, ge=1, description="Rows written to the validation file.")
    seed: Seed = Field(0, description="Seed of the generated rows.")
    copy_share: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="vault: share of the train rows that are copy rows "
        "(copying is what reading a tool's answer takes).",
    )


class DataConfig(Section):
    """Prompts: verl-style parquet/JSONL rows (`prompt`, `data_source`, `reward_model.ground_truth`)."""

    train_files: str | list[str] = Field(description="Parquet or JSONL file(s), any fsspec URL.")
    val_files: str | list[str] | None = Field(description="Validation file(s); needed when `trainer.test_freq` > 0.")
    prompt_key: str = Field(description="Column holding the prompt (chat messages or text).")
    train_batch_size: int = Field(ge=1, description="Prompts per training step.")
    gen_batch_size: int | None = Field(
        ge=1,
        description="Prompts per generation batch; null = train_batch_size (names the cache directory). Only "
        "dynamic sampling (algorithm.filter_groups) may set it apart, in the per-step modes.",
    )
    val_batch_size: int | None = Field(
        ge=1, description="Prompts per validation generation; null = the whole validation set."
    )
    max_prompt_length: int = Field(ge=1, description="Longest prompt in tokens.")
    max_response_length: int = Field(ge=1, description="Most tokens generated per response.")
    filter_overlong_prompts: bool = Field(
        description="Drop prompts longer than max_prompt_length instead of applying `truncation`."
    )
    truncation: Literal["error", "left", "right"] = Field(
        description="What to do with an overlong prompt that is not filtered."
    )
    seed: Seed = Field(
        description="Seed of the dataloader's shuffle (also of the mini-batch shuffles and the critic's value head)."
    )
    shuffle: bool = Field(description="Shuffle the train set every epoch.")
    return_raw_chat: bool = Field(
        description="Accepted for verl's command lines, no effect: verl keeps the raw chat for its rollout to "
        "template; here chat prompts are templated once, when the data is loaded."
    )
    apply_chat_template_kwargs: dict[str, Any] = Field(
        description="Extra arguments of the tokenizer's `apply_chat_template` for chat prompts, e.g. "
        "`{enable_thinking: false}` (Qwen3)."
    )
    synthetic: SyntheticDataConfig | None = Field(
        description="Generate the data files from a built-in task when they are missing, announced on the console. "
        "A preset's task belongs to the preset's files: a `key=value` override of `data.train_files` or "
        "`data.val_files` drops it unless a `data.synthetic.*` key is overridden too (e.g. "
        "`data.synthetic.seed=0`), so a missing file is an error, never fresh synthetic data."
    )
