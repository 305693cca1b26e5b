"""What one training run is made of, built once before the first step and never changed after.

:func:`start_run` checks and loads everything cheap first (models, data, scorers), so that bad input
fails before Ray starts, then starts the workers. The :class:`RunContext` it returns is immutable: what
changes from step to step lives in :class:`~ppoflow.flows.state.TrainerState`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prefect.context import FlowRunContext
from tensordict import TensorDict

from ppoflow.algorithms.scoring import Scorer
from ppoflow.configs import ConfigError
from ppoflow.configs.normalize import rollout_dtype_line, samples_on_gpu
from ppoflow.configs.schema import PPOConfig
from ppoflow.data.datasets import PromptDataset
from ppoflow.flows.cached_stages.planning import stage_caches
from ppoflow.flows.logs import note
from ppoflow.flows.preflight import preflight
from ppoflow.flows.stages import RolloutOrigin, Stages, derived_from
from ppoflow.storage.batch import NON_TENSOR_FIELDS, with_non_tensor_columns
from ppoflow.storage.step_cache.sample_cache import sample_id
from ppoflow.tasks.startup import load_data, start_workers
from ppoflow.workers.memory_estimate import memory_note
from ppoflow.workers.remote_reward import RemoteReward
from ppoflow.workers.roles import Workers
from ppoflow.workers.rollout.sampling import SamplingParams


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
    model_reward: Any
    """What scores each response in the reward_model stage (the reward model's role, or the reward service's
    client); None = rules only."""
    workers: Workers
    stages: Stages
    sampling: SamplingParams

    def prompts(self, step: int, epoch: int, rows: list[int]) -> TensorDict:
        """The prompt batch of ``step`` from train-set ``rows`` (drawn in ``epoch``); uids are ``{step}-{i}``,
        and each prompt's ``sample_id`` is its place in the feed order (verl's ``sample_{epoch}_{index}``,
        ``index`` counting prompts from 1 over the run), which keys the rollout service's sample cache."""
        batch = self.train_set.batch(rows, [f"{step}-{i}" for i in range(len(rows))], self.tokenizer.pad_token_id)
        first = (step - 1) * len(rows) + 1
        prompts = with_non_tensor_columns(batch, {"sample_id": [sample_id(epoch, first + i) for i in range(len(rows))]})
        derived_from(self.train_set, prompts)  # generation's input: the data load_data read
        return prompts

    def share(self, batch: TensorDict):
        """Place the batch's tensors once where every worker can read them (Ray's object store); the
        reference comes from the task run the batch came from (:func:`derived_from`)."""
        shared = self.workers.put(batch.exclude(*NON_TENSOR_FIELDS))
        derived_from(batch, shared)
        return shared


def start_run(cfg: PPOConfig, *, orchestrated: bool = True) -> RunContext:
    """Check everything that can fail first (:func:`~ppoflow.flows.preflight.preflight`), then load what
    the run reads and start the workers (in Ray when ``orchestrated``): two task runs inside a flow run,
    each noted with its duration."""
    preflight(cfg)
    if cfg.reward_model.reward_manager == "ray" and not orchestrated:
        raise ConfigError(
            [
                (
                    "reward_model.reward_manager",
                    "reward_model.reward_manager=ray scores in Prefect tasks "
                    "on Ray workers, which exist only in an orchestrated flow run: run it as a flow (and "
                    "set PREFECT_API_URL)",
                )
            ]
        )
    as_tasks = orchestrated and FlowRunContext.get() is not None
    started = time.perf_counter()
    inputs = (load_data if as_tasks else load_data.fn)(cfg)
    note(
        f"loaded the tokenizer and data in {time.perf_counter() - started:.1f} s "
        f"({len(inputs.train_set)} training prompts, {len(inputs.val_set) if inputs.val_set else 0} validation)"
    )
    batches_per_epoch = len(inputs.train_set) // cfg.data.train_batch_size
    total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches_per_epoch
    reward_chunks = cfg.reward_model.num_workers if cfg.reward_model.reward_manager == "ray" else 0
    caches = stage_caches(cfg)
    note(memory_note(cfg))
    rollout = cfg.actor_rollout_ref.rollout
    on_gpu = samples_on_gpu(rollout.name, rollout.resources.num_gpus, cfg.trainer.n_gpus_per_node)
    note(rollout_dtype_line(rollout.dtype, on_gpu=on_gpu))
    started = time.perf_counter()
    workers = (start_workers if as_tasks else start_workers.fn)(cfg, in_ray=orchestrated)
    placement = workers.placement_note()
    note(
        f"started the workers ({', '.join(workers.roles())}) in {time.perf_counter() - started:.1f} s"
        + (f"; {placement}" if placement else "")
    )
    tags = (
        (f"mode:{cfg.trainer.mode}", f"experiment:{cfg.trainer.experiment_name}") if cfg.trainer.task_run_tags else None
    )
    sampling = SamplingParams.for_training(cfg)
    return RunContext(
        cfg,
        inputs.tokenizer,
        inputs.train_set,
        inputs.val_set,
        total_steps,
        inputs.custom_scorer,
        reward_chunks,
        workers.reward_model or (RemoteReward(cfg.reward_model.remote) if cfg.reward_model.remote.url else None),
        workers,
        Stages(workers, caches, orchestrated=orchestrated, rollout=RolloutOrigin.of(cfg, sampling), tags=tags),
        sampling,
    )
