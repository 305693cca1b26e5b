"""What one training run is made of, built once before the first step and never changed after.

:func:`start_run` checks and loads everything cheap first (models, data, scorers), so that bad input
fails before Ray starts, then starts the workers. The :class:`RunContext` it returns is immutable: what
changes from step to step lives in :class:`~ppoflow.flows.state.TrainerState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.settings import get_current_settings
from tensordict import TensorDict

from ppoflow.algorithms.scoring import Scorer, load_custom_scorer, scorer_for
from ppoflow.configs.schema import PPOConfig
from ppoflow.data.datasets import PromptDataset, ensure_datasets, load_prompt_dataset
from ppoflow.flows.stages import Stages
from ppoflow.storage.batch import NON_TENSOR_FIELDS
from ppoflow.tasks.stages import stage_caches
from ppoflow.workers.group import Workers, start_local_workers, start_workers
from ppoflow.workers.models import check_context_length, ensure_model, load_tokenizer
from ppoflow.workers.rollout import SamplingParams


@dataclass(frozen=True)
class RunContext:
    """Everything the steps of one run share: config, tokenizer, datasets, scorers, workers, stages."""

    cfg: PPOConfig
    tokenizer: Any
    train_set: PromptDataset
    val_set: PromptDataset | None
    total_steps: int
    custom_scorer: Scorer | None
    reward_chunks: int
    """``reward_model.reward_manager=ray``: score in this many chunks on Ray workers; 0 = in the flow."""
    workers: Workers
    stages: Stages
    sampling: SamplingParams

    def prompts(self, step: int, rows: list[int]) -> TensorDict:
        """The prompt batch of ``step`` from train-set ``rows``; uids are ``{step}-{i}``."""
        return self.train_set.batch(rows, [f"{step}-{i}" for i in range(len(rows))], self.tokenizer.pad_token_id)

    def share(self, batch: TensorDict):
        """Place the batch's tensors once where every worker can read them (Ray's object store)."""
        return self.workers.put(batch.exclude(*NON_TENSOR_FIELDS))

    def rollout_identity(self) -> dict:
        """How this run samples: what a cached rollout records about the run that sampled it."""
        model = self.cfg.actor_rollout_ref.model
        return {"sampling": self.sampling.as_dict(), "model_path": model.path,
                "tokenizer_path": model.tokenizer_path or model.path}


def start_run(cfg: PPOConfig, *, orchestrated: bool = True) -> RunContext:
    """Prepare data, tokenizer and scorers (cheap, so bad input fails first), then start the workers."""
    data = cfg.data
    context = data.max_prompt_length + data.max_response_length
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    check_context_length(cfg.actor_rollout_ref.model, context, "actor_rollout_ref.model.path")
    if cfg.use_critic:
        ensure_model(cfg.critic.model, "critic.model.path")
        check_context_length(cfg.critic.model, context, "critic.model.path")
    ensure_datasets(data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    train_set = load_prompt_dataset(data.train_files, data, tokenizer, key="data.train_files")
    val_set = load_prompt_dataset(data.val_files, data, tokenizer, key="data.val_files") if data.val_files else None
    custom = cfg.custom_reward_function
    custom_scorer = load_custom_scorer(custom.path, custom.name) if custom.path else None
    for dataset in filter(None, (train_set, val_set)):
        for source in sorted(set(dataset.data_sources)):
            scorer_for(source, custom_scorer)  # every data source has a scorer, or fail now
    batches_per_epoch = len(train_set) // data.train_batch_size
    total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches_per_epoch
    reward_chunks = 0
    if cfg.reward_model.reward_manager == "ray":
        if not orchestrated or not get_current_settings().api.url:
            raise ValueError("reward_model.reward_manager=ray scores in Prefect tasks on Ray workers, which must "
                             "report to a Prefect server: set PREFECT_API_URL (and run the flow orchestrated)")
        reward_chunks = cfg.reward_model.num_workers
    caches = stage_caches(cfg)
    workers = start_workers(cfg) if orchestrated else start_local_workers(cfg)
    return RunContext(cfg, tokenizer, train_set, val_set, total_steps, custom_scorer, reward_chunks, workers,
                      Stages(workers, caches, orchestrated=orchestrated), SamplingParams.for_training(cfg))
