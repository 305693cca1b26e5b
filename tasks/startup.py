"""Start-up, as task runs: loading what the run reads, and starting its workers.

They take most of a short run's first seconds (starting a worker imports torch and transformers and
loads the model), so they show on the flow run's timeline as ``load_data`` and ``start_workers``
rather than as a blank before the first step. Neither is ever retried or cached: a run starts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect.cache_policies import NO_CACHE

from ppoflow.algorithms.scoring import Scorer
from ppoflow.configs.schema import PPOConfig
from ppoflow.data.datasets import PromptDataset, ensure_datasets, load_prompt_dataset
from ppoflow.tasks.task_inputs import recorded_task
from ppoflow.workers.launcher import start_local_workers
from ppoflow.workers.launcher import start_workers as start_ray_workers
from ppoflow.workers.models import ensure_model, load_tokenizer
from ppoflow.workers.roles import Workers
from ppoflow.workers.service.scorer_process import configured_scorer


@dataclass(frozen=True)
class RunInputs:
    """What the driver reads before the first step."""

    tokenizer: Any
    train_set: PromptDataset
    val_set: PromptDataset | None
    custom_scorer: Scorer | None


@recorded_task(name="load_data", cache_policy=NO_CACHE, task_run_name="load_data")
def load_data(cfg: PPOConfig) -> RunInputs:
    """Build or generate what the config asks for (a tiny model, the synthetic task), then load the
    tokenizer, the train and validation sets and a custom reward function (run in a process of its own, with
    its deadline: :class:`~ppoflow.workers.service.scorer_process.ScorerProcess`)."""
    data = cfg.data
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    if cfg.use_critic:
        ensure_model(cfg.critic.model, "critic.model.path")
    ensure_datasets(data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    train_set = load_prompt_dataset(data.train_files, data, tokenizer, key="data.train_files")
    val_set = load_prompt_dataset(data.val_files, data, tokenizer, key="data.val_files") if data.val_files else None
    return RunInputs(tokenizer, train_set, val_set, configured_scorer(cfg.custom_reward_function))


@recorded_task(name="start_workers", cache_policy=NO_CACHE, task_run_name="start_workers")
def start_workers(cfg: PPOConfig, in_ray: bool = True) -> Workers:
    """One long-lived worker per role, loaded and ready: Ray actors, or in-process objects (``in_ray``
    false: the overhead benchmark's baseline)."""
    return start_ray_workers(cfg) if in_ray else start_local_workers(cfg)
