"""What one training run is made of, built once before the first step and never changed after.

:func:`start_run` checks and loads everything cheap first (models, data, scorers), so that bad input
fails before Ray starts, then starts the workers. The :class:`RunContext` it returns is immutable: what
changes from step to step lives in :class:`~ppoflow.flows.state.TrainerState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tensordict import TensorDict

from ppoflow.algorithms.scoring import Scorer, load_custom_scorer
from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig
from ppoflow.data.datasets import PromptDataset, ensure_datasets, load_prompt_dataset
from ppoflow.flows.preflight import preflight
from ppoflow.flows.stages import Stages
from ppoflow.storage.batch import NON_TENSOR_FIELDS
from ppoflow.storage.fingerprints import model_identity, tokenizer_identity
from ppoflow.tasks.stages import stage_caches
from ppoflow.workers.group import Workers, start_local_workers, start_workers
from ppoflow.workers.models import ensure_model, load_tokenizer
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

    @cached_property
    def rollout_identity(self) -> dict:
        """What a cached rollout must have been sampled with to be replayed here: the sampling settings
        that shape the samples (not the seed), and the identities of the model and the tokenizer."""
        sampling = self.sampling.as_dict()
        del sampling["seed"]
        model = self.cfg.actor_rollout_ref.model
        return {"sampling": sampling, "model": model_identity(model.path),
                "tokenizer": tokenizer_identity(model.tokenizer_path or model.path)}

    def rollout_record(self) -> dict:
        """What a cached rollout records beside its identity, for people reading the cache."""
        model = self.cfg.actor_rollout_ref.model
        return {"model_path": model.path, "tokenizer_path": model.tokenizer_path or model.path,
                "seed": self.sampling.seed}


def start_run(cfg: PPOConfig, *, orchestrated: bool = True) -> RunContext:
    """Check everything that can fail first (:func:`~ppoflow.flows.preflight.preflight`), build or generate
    what the config asks for, load tokenizer, data and scorers, then start the workers."""
    preflight(cfg)
    if cfg.reward_model.reward_manager == "ray" and not orchestrated:
        raise ConfigError([("reward_model.reward_manager", "reward_model.reward_manager=ray scores in Prefect tasks "
                            "on Ray workers, which exist only in an orchestrated flow run: run it as a flow (and "
                            "set PREFECT_API_URL)")])
    data = cfg.data
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    if cfg.use_critic:
        ensure_model(cfg.critic.model, "critic.model.path")
    ensure_datasets(data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    train_set = load_prompt_dataset(data.train_files, data, tokenizer, key="data.train_files")
    val_set = load_prompt_dataset(data.val_files, data, tokenizer, key="data.val_files") if data.val_files else None
    custom = cfg.custom_reward_function
    custom_scorer = load_custom_scorer(custom.path, custom.name) if custom.path else None
    batches_per_epoch = len(train_set) // data.train_batch_size
    total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches_per_epoch
    reward_chunks = cfg.reward_model.num_workers if cfg.reward_model.reward_manager == "ray" else 0
    caches = stage_caches(cfg)
    workers = start_workers(cfg) if orchestrated else start_local_workers(cfg)
    return RunContext(cfg, tokenizer, train_set, val_set, total_steps, custom_scorer, reward_chunks, workers,
                      Stages(workers, caches, orchestrated=orchestrated), SamplingParams.for_training(cfg))
