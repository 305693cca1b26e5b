"""The typed schema of a ppoflow run configuration: what each key means and which values are legal.

Defaults live in ``configs/ppo_trainer.yaml`` (the one place for the defaults of every required key; optional
sections such as ``model.build`` or ``skip.<stage>`` carry their own field defaults, as the YAML has no entry for
them). Every model forbids unknown keys and is strict (no ``"yes"`` -> ``True``), so a typo fails before any worker
starts. The sections live in ``configs/schema_<section>.py`` and are importable from here; rules that relate several
keys live in :mod:`configs.rules`. Key names follow verl's ``ppo_trainer.yaml`` wherever the concept exists; the
names of the algorithms' choices come from the algorithms themselves.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ppoflow.configs.modes import needs_of
from ppoflow.configs.schema_algorithm import (
    AlgorithmConfig,
    CustomRewardConfig,
    KLControlConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
)
from ppoflow.configs.schema_base import (
    PATH_NAME_PATTERN,
    PATH_NAME_RULE,
    RAY_RESOURCE_UNIT,
    SEED_MAX,
    PathName,
    ResourcesConfig,
    Section,
    Seed,
)
from ppoflow.configs.schema_data import DataConfig, SyntheticDataConfig
from ppoflow.configs.schema_models import (
    ActorConfig,
    AdamBeta,
    CriticConfig,
    FSDPConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimConfig,
    PPOUpdateConfig,
    RefConfig,
    TinyModelConfig,
    TrainingEngineConfig,
)
from ppoflow.configs.schema_profiler import GlobalProfilerConfig, ProfilerConfig
from ppoflow.configs.schema_rollout import (
    ActorRolloutRefConfig,
    AgentConfig,
    MultiTurnConfig,
    RolloutConfig,
    RolloutPoolConfig,
    ValSamplingConfig,
    WeightSyncConfig,
)
from ppoflow.configs.schema_trainer import (
    LOGGERS,
    ColocateAsyncConfig,
    CustomSamplerConfig,
    RayConfig,
    SamplerConfig,
    SeparateAsyncConfig,
    SkipStageConfig,
    TrainerConfig,
    TrainerV1Config,
)
from ppoflow.configs.stages import STAGES_WITH_SKIP

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AdamBeta",
    "AgentConfig",
    "AlgorithmConfig",
    "ColocateAsyncConfig",
    "CriticConfig",
    "CustomRewardConfig",
    "CustomSamplerConfig",
    "DataConfig",
    "FSDPConfig",
    "GlobalProfilerConfig",
    "KLControlConfig",
    "LOGGERS",
    "MixedPrecisionConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimConfig",
    "PATH_NAME_PATTERN",
    "PATH_NAME_RULE",
    "PPOConfig",
    "PPOUpdateConfig",
    "PathName",
    "ProfilerConfig",
    "RAY_RESOURCE_UNIT",
    "RayConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloutPoolConfig",
    "SEED_MAX",
    "SamplerConfig",
    "Section",
    "Seed",
    "SeparateAsyncConfig",
    "SkipStageConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "TrainerV1Config",
    "TrainingEngineConfig",
    "ValSamplingConfig",
    "WeightSyncConfig",
]


class PPOConfig(Section):
    """A whole run."""

    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    custom_reward_function: CustomRewardConfig
    reward_model: RewardModelConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    rollout: RolloutPoolConfig
    ray: RayConfig
    global_profiler: GlobalProfilerConfig
    skip: dict[Literal[STAGES_WITH_SKIP], SkipStageConfig] = Field(  # type: ignore[valid-type]
        description="Per-stage result caching, keyed by stage name."
    )

    @property
    def use_critic(self) -> bool:
        """Whether a critic worker runs: explicit `critic.enable`, else only for GAE."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        """Whether reference log-probs are needed (a KL term); a reference worker computes them unless
        :attr:`ref_in_actor`."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def ref_in_actor(self) -> bool:
        """Whether the reference is the actor's base model with its LoRA adapter disabled (verl's name): a run
        that needs a reference and trains LoRA starts no reference worker, nor a second copy of the weights."""
        return self.use_reference and self.actor_rollout_ref.model.lora

    @property
    def data_parallel_size(self) -> int:
        """The number W of ranks each training role (actor, ref, critic) runs as, one torch.distributed process
        group per role: ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` on GPUs, x
        ``trainer.n_cpu_ranks_per_node`` when the training pool is on CPUs (n_gpus_per_node=0)."""
        trainer = self.trainer
        return trainer.nnodes * (
            trainer.n_gpus_per_node if trainer.n_gpus_per_node > 0 else trainer.n_cpu_ranks_per_node
        )

    @property
    def colocated(self) -> bool:
        """Whether the actor's ranks also serve generation (``actor_rollout_ref.hybrid_engine``, resolved; verl's
        default layout, at any number of ranks). null resolves to True for a run of an on-policy trainer mode
        (:attr:`ModeNeeds.on_policy`) with hf, batch generation (``rollout.mode=sync``; the rollout service keeps
        replicas of its own unless hybrid_engine=true) and object_store, actor and rollout on the same kind of
        device."""
        arr = self.actor_rollout_ref
        if arr.hybrid_engine is not None:
            return arr.hybrid_engine
        return (
            needs_of(self.trainer.mode).on_policy
            and arr.rollout.name == "hf"
            and arr.rollout.mode == "sync"
            and arr.rollout.weight_sync.backend == "object_store"
            and (arr.rollout.resources.num_gpus > 0) == (arr.actor.resources.num_gpus > 0)
        )

    @property
    def old_log_probs_from_update(self) -> bool:
        """Whether the old log-probs are the actor update's own log-probs, detached, so the old_log_prob
        forward pass is skipped (verl's and TRL's on-policy shortcut). That is exact when the update is
        on-policy - one PPO epoch over one mini-batch, so the policy has not moved when each token's loss is
        taken - and nothing needs the old log-probs before the update: no rollout correction (bypass mode
        uses the rollout's own), no KL penalty in the reward, no cached old_log_prob stage."""
        actor, correction = self.actor_rollout_ref.actor, self.algorithm.rollout_correction
        cached = self.skip.get("old_log_prob")
        return (
            actor.ppo_epochs == 1
            and actor.ppo_mini_batch_size >= self.data.train_batch_size
            and not correction.bypass_mode
            and not correction.rollout_is
            and not correction.rollout_rs
            and not self.algorithm.use_kl_in_reward
            and not (cached and cached.enable)
        )

    @property
    def judge_model(self) -> ModelConfig | None:
        """The judge's own model (``reward_model.judge.model``) as a model section, for the code that loads and
        checks models; None when the policy's replicas judge."""
        judge = self.reward_model.judge.model
        if judge.path is None:
            return None
        return self.actor_rollout_ref.model.model_copy(
            update={
                **judge.model_dump(),
                "enable_gradient_checkpointing": False,
                "use_remove_padding": False,
                "build": None,
                "lora_rank": 0,
                "lora_adapter_path": None,
            }
        )

    @property
    def gen_batch_size(self) -> int:
        """Prompts per generation (verl: gen_batch_size, else train_batch_size)."""
        return self.data.gen_batch_size or self.data.train_batch_size
