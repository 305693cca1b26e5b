"""The typed schema of a ppoflow run configuration: what each key means and which values are legal.

Defaults live in ``configs/ppo_trainer.yaml`` (the one place for the defaults of every required key;
optional sections such as ``model.build`` or ``skip.<stage>`` carry their own field defaults here, as
the YAML has no entry for them). Every model forbids unknown keys and is strict (no ``"yes"`` ->
``True``, no ``True`` inside a list of ints), so a typo fails before any worker starts. Rules that
relate several keys live in :mod:`configs.rules`. Key names follow verl's ``ppo_trainer.yaml``
wherever the concept exists; the names of the algorithms' choices come from the algorithms themselves.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ppoflow.algorithms.names import ADVANTAGE_ESTIMATORS, IS_LEVELS, KL_PENALTY_KINDS, LOSS_AGG_MODES
from ppoflow.configs.stages import STAGES_WITH_SKIP

LOGGERS = ("console", "tensorboard")


class Section(BaseModel):
    """Base of every config section: strict types, unknown keys rejected, immutable once built, and no
    float may be inf or nan (YAML's ``.inf``/``.nan`` would otherwise pass every range check)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


SEED_MAX = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
"""A random seed: numpy seeds only from [0, 2**32 - 1] (vLLM seeds numpy with ``rollout.seed``), and every
seed of a run takes that one range."""


# ----------------------------------------------------------------------------------------- data


class SyntheticDataConfig(Section):
    """Built-in synthetic task; when set, missing ``train_files``/``val_files`` are generated from it
    (see ``DataConfig.synthetic`` for when a preset's task applies)."""

    task: Literal["copy", "vault"] = Field(
        "copy",
        description="Synthetic task: `copy` = repeat the prompt's digits, then stop; `vault` = answer the "
        "code the prompt's key opens, which the `vault` tool tells (see ppoflow.data.vault).",
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
        ge=1, description="Prompts per generation; null = train_batch_size (names the cache directory)."
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
    synthetic: SyntheticDataConfig | None = Field(
        description="Generate the data files from a built-in task when they are missing, announced on the console. "
        "A preset's task belongs to the preset's files: a `key=value` override of `data.train_files` or "
        "`data.val_files` drops it unless a `data.synthetic.*` key is overridden too (e.g. "
        "`data.synthetic.seed=0`), so a missing file is an error, never fresh synthetic data."
    )


# ---------------------------------------------------------------------------------------- models


class TinyModelConfig(Section):
    """A random-init Llama with a character tokenizer, built into `model.path` when it holds no model
    (see ``ModelConfig.build`` for when a preset's recipe applies)."""

    hidden_size: int = Field(128, ge=8, description="Llama hidden size.")
    intermediate_size: int = Field(256, ge=8, description="Llama MLP size.")
    num_hidden_layers: int = Field(2, ge=1, description="Llama layers.")
    num_attention_heads: int = Field(
        4, ge=1, description="Attention heads (must divide hidden_size into an even head size)."
    )
    max_position_embeddings: int = Field(64, ge=8, description="Longest prompt + response the model accepts.")
    seed: Seed = Field(0, description="Seed of the random initialisation.")

    @field_validator("num_attention_heads")
    @classmethod
    def _heads_divide_hidden_size(cls, heads: int, info: ValidationInfo) -> int:
        """Each head takes ``hidden_size / heads`` dimensions, an even number as rotary position embeddings turn
        them in pairs; transformers would fail only when building, or at the first forward pass."""
        hidden = info.data.get("hidden_size")  # absent when hidden_size itself was invalid
        if hidden is not None and hidden % heads:
            raise PydanticCustomError(
                "heads_divide_hidden_size", "must divide hidden_size={hidden_size}", {"hidden_size": hidden}
            )
        if hidden is not None and (hidden // heads) % 2:
            raise PydanticCustomError(
                "head_size_odd",
                "gives an odd head size hidden_size / num_attention_heads = "
                "{head_size}; rotary embeddings need an even one",
                {"head_size": hidden // heads},
            )
        return heads


class ModelConfig(Section):
    path: str = Field(description="Hugging Face causal-LM directory (local path or fsspec URL).")
    tokenizer_path: str | None = Field(description="Tokenizer directory; null = `path`.")
    trust_remote_code: bool = Field(description="Passed to transformers' from_pretrained.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Parameter dtype of the loaded model.")
    enable_gradient_checkpointing: bool = Field(
        description="Recompute each decoder layer's activations in the backward pass of the role's updates instead "
        "of keeping them (actor, critic): activation memory of about one layer instead of all, for about one more "
        "forward pass. No effect on roles that do not train (ref, rollout)."
    )
    build: TinyModelConfig | None = Field(
        description="Build a random-init tiny Llama into `path` when it holds no model (demo and tests), announced on "
        "the console. A recipe belongs to the path it was written for: a `key=value` override of this "
        "model's `path` drops the preset's recipe unless a `build.*` key of the same model is overridden "
        "too (e.g. `build.seed=0`), so a path without a model is an error, never a fresh random model."
    )


RAY_RESOURCE_UNIT = 1e-4
"""The smallest non-zero amount of a resource Ray reserves (its fractional precision)."""


def _ray_amount_problem(amount: float) -> str | None:
    """Why Ray would refuse ``amount`` of a resource when the actor is created, or None."""
    if amount < 0:
        return "must be >= 0"
    if 0 < amount < RAY_RESOURCE_UNIT:
        return f"must be 0 or at least {RAY_RESOURCE_UNIT:g} (Ray's resource precision)"
    return None


class ResourcesConfig(Section):
    """What one Ray actor of a role reserves, and how many torch threads it uses. Ray refuses an amount only
    when the actor is created; the config refuses it first."""

    num_cpus: float = Field(
        ge=0, description=f"Ray CPUs reserved by the role's actor: 0 or at least {RAY_RESOURCE_UNIT:g}."
    )
    num_gpus: float = Field(
        ge=0, description=f"Ray GPUs reserved by the role's actor: 0 or at least {RAY_RESOURCE_UNIT:g}."
    )
    num_threads: int = Field(ge=1, description="torch.set_num_threads inside the actor.")
    custom: dict[str, float] = Field(
        description="Ray custom resources each actor of the role reserves (e.g. {trainer_node: 1} to pin the role to "
        f"nodes started with `ray start --resources`); each amount 0 or at least {RAY_RESOURCE_UNIT:g}."
    )

    @field_validator("num_cpus", "num_gpus")
    @classmethod
    def _ray_precision(cls, amount: float) -> float:
        if (problem := _ray_amount_problem(amount)) is not None:
            raise PydanticCustomError("ray_resource_amount", problem)
        return amount

    @field_validator("custom")
    @classmethod
    def _custom_amounts(cls, custom: dict[str, float]) -> dict[str, float]:
        for amount in custom.values():
            if (problem := _ray_amount_problem(amount)) is not None:
                raise PydanticCustomError("ray_resource_amount", f"each amount {problem}")
        return custom


AdamBeta = Annotated[float, Field(ge=0, lt=1)]
"""An AdamW moving-average coefficient: torch accepts [0, 1)."""


class OptimConfig(Section):
    lr: float = Field(gt=0, description="AdamW learning rate.")
    betas: list[AdamBeta] = Field(min_length=2, max_length=2, description="AdamW betas, each in [0, 1).")
    weight_decay: float = Field(ge=0, description="AdamW weight decay.")
    lr_warmup_steps: int = Field(ge=0, description="Linear warm-up of the learning rate over this many updates.")


class MixedPrecisionConfig(Section):
    """FSDP2's ``MixedPrecisionPolicy``: the dtype the sharded model computes in and reduces gradients in."""

    param_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        description="Dtype the gathered parameters compute in (the sharded master copy keeps model.dtype); null = "
        "compute in the model's dtype, no mixed precision."
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(description="Dtype of the gradient reduction over the ranks.")


class FSDPConfig(Section):
    """How FSDP2 (``fully_shard``) shards a role's model over its ranks (verl's ``fsdp_config`` keys)."""

    offload_policy: bool = Field(
        description="FSDP2 CPUOffloadPolicy: parameters, gradients and optimizer state in CPU "
        "memory between uses (GPUs only)."
    )
    reshard_after_forward: bool = Field(
        description="Free the gathered parameters after forward (gathered again for "
        "backward): less memory, one more all-gather."
    )
    mixed_precision: MixedPrecisionConfig


class TrainingEngineConfig(Section):
    """What every training role (actor, ref, critic) shares: the engine that runs its model over its ranks
    (``PPOConfig.data_parallel_size`` of them)."""

    strategy: Literal["fsdp2"] = Field(
        description="Training engine (verl's key): FSDP2 `fully_shard` over the role's "
        "ranks; with one rank the model trains unsharded."
    )
    fsdp_config: FSDPConfig


class PPOUpdateConfig(TrainingEngineConfig):
    """What the actor and the critic share: how one step's batch is cut up and trained on."""

    ppo_mini_batch_size: int = Field(ge=1, description="Prompts per optimizer step (times rollout.n trajectories).")
    ppo_micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Trajectories per forward/backward; null = whole mini-batch."
    )
    ppo_epochs: int = Field(ge=1, description="Passes over the step's batch.")
    shuffle: bool = Field(description="Shuffle trajectories between mini-batches.")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = Field(description="How per-token losses are reduced.")  # type: ignore[valid-type]
    grad_clip: float = Field(gt=0, description="Gradient-norm clip.")
    optim: OptimConfig
    resources: ResourcesConfig


class ActorConfig(PPOUpdateConfig):
    clip_ratio_low: float = Field(
        gt=0, lt=1, description="PPO clip: lower bound 1 - clip_ratio_low, a ratio in (0, 1)."
    )
    clip_ratio_high: float = Field(
        gt=0, description="PPO clip: upper bound 1 + clip_ratio_high (DAPO clip-higher when larger)."
    )
    clip_ratio_c: float = Field(gt=1, description="Dual-clip constant for negative advantages.")
    entropy_coeff: float = Field(ge=0, description="Entropy bonus coefficient.")
    use_kl_loss: bool = Field(description="Add a KL-to-reference loss (needs the ref worker).")
    kl_loss_coef: float = Field(ge=0, description="Coefficient of the KL loss.")
    kl_loss_type: Literal[KL_PENALTY_KINDS] = Field(  # type: ignore[valid-type]
        description="KL estimator of the KL loss (k1/k2/k3 by verl's names; a `+` suffix = k2 gradient)."
    )


class RefConfig(TrainingEngineConfig):
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Trajectories per reference forward; null = all."
    )
    resources: ResourcesConfig


class ValSamplingConfig(Section):
    n: int = Field(ge=1, description="Samples per validation prompt.")
    do_sample: bool = Field(description="Sample (true) or greedy (false) during validation.")
    temperature: float = Field(ge=0, description="Validation sampling temperature; 0 = greedy.")
    top_p: float = Field(gt=0, le=1, description="Validation nucleus sampling mass.")
    top_k: int = Field(ge=-1, description="Validation top-k; -1 or 0 = off.")


class WeightSyncConfig(Section):
    """How the actor's new weights reach the rollout worker (the ``weight_sync`` stage)."""

    backend: Literal["object_store", "nccl", "gloo"] = Field(
        description="object_store: buckets through Ray's shared-memory store (one node, CPU or GPU); nccl / gloo: "
        "a Ray collective group broadcasting buckets between the actor and the rollout (GPUs / CPUs)."
    )
    bucket_mb: int = Field(ge=1, description="Tensors are packed into flat buckets of at most this many MiB.")
    delta: bool = Field(description="Send only the tensors that changed since the last sync.")


class AgentConfig(Section):
    """Agent loops of the rollout service (``rollout.mode=async``): how each trajectory is produced."""

    num_workers: int = Field(
        ge=1,
        description="Agent-loop workers (asyncio Ray actors, no CPU reserved); each runs "
        "the loops of its share of the prompts concurrently.",
    )
    default_agent_loop: str = Field(
        min_length=1,
        description="Loop for rows without an `agent_name` column: single_turn_agent, tool_agent, or a registered one.",
    )
    agent_loop_config_path: str | None = Field(
        description="YAML list of {name, _target_: module.Class} entries registering more agent loops."
    )


class MultiTurnConfig(Section):
    """Tool use in ``tool_agent`` (verl's ``rollout.multi_turn`` keys)."""

    format: Literal["hermes", "question_mark"] = Field(
        description="How a model turn calls a tool: hermes (<tool_call>{json}</tool_call>, answers rendered by the "
        "chat template) or question_mark (a turn ending in `?` calls the first tool with the text before "
        "it; answers written `=answer>`; for character-level toy models)."
    )
    max_assistant_turns: int = Field(ge=1, description="Model turns per trajectory at most.")
    max_tokens_per_turn: int | None = Field(
        ge=1,
        description="Tokens one model turn may generate at most (within "
        "data.max_response_length for the whole trajectory); "
        "null = the remaining response budget.",
    )
    max_tool_response_length: int = Field(ge=1, description="Tokens of one tool answer kept at most.")
    tool_config_path: str | None = Field(
        description="YAML file declaring the tools (OpenAI function schemas and "
        "the Python callables behind them); null = no tools."
    )
    tool_processes: int = Field(ge=1, description="Sandbox processes per agent worker that run tool calls.")


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field(
        description="Generation engine: `hf` (transformers/torch, CPU or GPU) or `vllm` (GPU)."
    )
    mode: Literal["sync", "async"] = Field(
        description="sync: one worker generates each batch in one call (static batching); async: the rollout "
        "service - num_replicas replicas serving per-request generation with continuous batching, "
        "called by agent loops per sample and per turn (multi-turn, tools)."
    )
    num_replicas: int = Field(ge=1, description="rollout.mode=async: generation replicas, each on rollout.resources.")
    max_num_seqs: int = Field(ge=1, description="rollout.mode=async: sequences a replica decodes at once.")
    n: int = Field(ge=1, description="Responses sampled per prompt (the GRPO group size).")
    temperature: float = Field(ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(ge=-1, description="Top-k sampling; -1 or 0 = off.")
    do_sample: bool = Field(description="false = greedy decoding.")
    seed: Seed = Field(description="Base seed of the rollout sampler (mixed with the step); vLLM's engine seed.")
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Trajectories per old-log-prob forward; null = all."
    )
    gpu_memory_utilization: float = Field(gt=0, le=1, description="vLLM: fraction of GPU memory for the engine.")
    tensor_model_parallel_size: int = Field(ge=1, description="vLLM: tensor-parallel degree.")
    val_kwargs: ValSamplingConfig
    weight_sync: WeightSyncConfig
    agent: AgentConfig
    multi_turn: MultiTurnConfig
    resources: ResourcesConfig


class ActorRolloutRefConfig(Section):
    hybrid_engine: bool | None = Field(
        description="Colocate: the actor's worker also generates, with its own model, so there are no weights to "
        "sync. null = wherever that works (trainer.mode=sync, rollout.name=hf, "
        "weight_sync.backend=object_store, actor and rollout on the same kind of device, one training rank: "
        "PPOConfig.data_parallel_size = 1, as a sharded actor cannot generate on each rank independently). "
        "Colocated, the rollout runs on the actor's resources; rollout.resources is unused."
    )
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig


class CriticConfig(PPOUpdateConfig):
    enable: bool | None = Field(description="Run a critic; null = only when algorithm.adv_estimator needs one (gae).")
    model: ModelConfig
    forward_micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Trajectories per value forward; null = all."
    )
    cliprange_value: float = Field(gt=0, description="Value clipping range around the old values.")


# ------------------------------------------------------------------------------ reward, algorithm


class CustomRewardConfig(Section):
    path: str | None = Field(
        description="`module:function`, `module`, or a .py file; null = built-in scorers by data_source."
    )
    name: str = Field(description="Function name when `path` names a module or file.")
    timeout_s: float = Field(
        gt=0,
        description="How long one call of the custom scorer may take; a stall is reported "
        "while it lasts, and a call past this is handled by `on_timeout`.",
    )
    on_timeout: Literal["fail", "score"] = Field(
        description="A scorer call past `timeout_s`: fail the step (naming the sample), or give the response "
        "`timeout_score` and go on (counted in reward/scorer_timeouts)."
    )
    timeout_score: float = Field(description="The score of a response whose scorer timed out (on_timeout=score).")


class RewardModelConfig(Section):
    """Where rule-based scoring runs (verl's ``reward_model.reward_manager``)."""

    reward_manager: Literal["naive", "ray"] = Field(
        description="naive: score in the flow; ray: score chunks as Prefect tasks on Ray workers (prefect-ray), "
        "for slow scorers (sandboxed code, remote judges). ray needs PREFECT_API_URL."
    )
    num_workers: int = Field(ge=1, description="reward_manager=ray: chunks scored at once.")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(description="In-reward KL coefficient controller.")
    kl_coef: float = Field(ge=0, description="(Initial) KL coefficient.")
    horizon: int = Field(gt=0, description="Adaptive controller horizon.")
    target_kl: float = Field(gt=0, description="Adaptive controller target KL.")


class RolloutCorrectionConfig(Section):
    """verl's off-policy correction between the rollout's sampling log-probs and the trainer's."""

    bypass_mode: bool = Field(
        description="Use the rollout's log-probs as old log-probs and skip the old_log_prob stage."
    )
    rollout_is: Literal[IS_LEVELS] | None = Field(  # type: ignore[valid-type]
        description="Importance-sampling weights old/rollout per token or per sequence; null = none."
    )
    rollout_is_threshold: float | str = Field(
        description='Truncate IS weights at this value, or "lo_hi" (e.g. "0.5_2.0") to zero weights outside '
        "[lo, hi] (IcePop)."
    )
    rollout_is_batch_normalize: bool = Field(description="Normalise IS weights to mean 1 over the batch.")
    rollout_rs: str | None = Field(
        description="Rejection sampling: comma list of token_k1|k2|k3, seq_sum_*, seq_mean_*, seq_max_k2|k3; "
        "null = none."
    )
    rollout_rs_threshold: float | str | list[float | str] | None = Field(
        description='Bound(s) for rollout_rs: one per option or one for all (k1 options take "lo_hi").'
    )


class AlgorithmConfig(Section):
    adv_estimator: Literal[ADVANTAGE_ESTIMATORS] = Field(description="Advantage estimator (gae needs a critic).")  # type: ignore[valid-type]
    gamma: float = Field(ge=0, le=1, description="Discount factor.")
    lam: float = Field(ge=0, le=1, description="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = Field(description="Divide GRPO advantages by the group std (false = Dr.GRPO).")
    use_kl_in_reward: bool = Field(
        description="Subtract a KL-to-reference penalty from the token rewards (needs the ref worker)."
    )
    kl_penalty: Literal[KL_PENALTY_KINDS] = Field(description="KL estimator of the in-reward penalty.")  # type: ignore[valid-type]
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig


# ------------------------------------------------------------------------------- trainer, ray, skip


class CustomSamplerConfig(Section):
    path: str | None = Field(description="A Python file holding a ReplayBuffer subclass; null = the built-in buffer.")
    name: str | None = Field(description="The class's name in that file.")


class SamplerConfig(Section):
    """verl's ``trainer.v1.sampler``: how the async modes' replay buffer bounds staleness."""

    max_off_policy_threshold: int = Field(
        ge=1,
        description="Largest span (training step - dispatch step + 1) a prompt group may have when it is trained on.",
    )
    max_off_policy_strategy: Literal["drop", "wait"] = Field(
        description="drop: evict finished groups whose span exceeds the threshold and feed as many fresh prompts; "
        "wait: sample only once no pending or running group has reached it."
    )
    custom_sampler: CustomSamplerConfig


class ColocateAsyncConfig(Section):
    num_warmup_batches: int = Field(
        ge=0,
        description="Train batches of prompts fed before the first step (prefetch "
        "depth), besides the one fed at every step.",
    )
    partial_rollout: bool = Field(
        description="A request aborted when the replicas sleep resumes from its partial "
        "output with the new weights (verl's partial rollout); false: it "
        "starts over with them, so no trajectory spans weight versions."
    )


class SeparateAsyncConfig(Section):
    num_warmup_batches: int = Field(ge=0, description="As colocate_async.num_warmup_batches.")
    parameter_sync_step: int = Field(
        ge=1,
        description="Mini-batch updates per training step between weight pushes; "
        "train_batch_size must be this x ppo_mini_batch_size.",
    )


class TrainerV1Config(Section):
    """verl's ``trainer.v1``: the trainer mode and the async modes' settings."""

    trainer_mode: str | None = Field(
        description="Trainer mode (the same setting as trainer.mode; null = trainer.mode's): sync, one_step_off, "
        "colocate_async, separate_async, or one registered with ppoflow.flows.modes.register_trainer."
    )
    trainer_module: str | None = Field(
        description="A Python file imported before trainer_mode is looked up: "
        "its @register_trainer classes become modes."
    )
    colocate_async: ColocateAsyncConfig
    separate_async: SeparateAsyncConfig
    sampler: SamplerConfig


PATH_NAME_PATTERN = r"^[A-Za-z0-9_](?:[A-Za-z0-9._+=@, -]{0,98}[A-Za-z0-9._+=@,-])?$"
"""A name that becomes one component of a path (run and cache directories): no ``/``, ``\\``, ``.``, ``..``,
control characters or leading ``-``, so no name can point outside the directory it is joined to."""
PATH_NAME_RULE = (
    "1 to 100 ASCII letters, digits, spaces and . _ - + = @ , starting with a letter, digit or _ and "
    "not ending in a space"
)
PathName = Annotated[str, Field(pattern=PATH_NAME_PATTERN)]


class TrainerConfig(Section):
    project_name: PathName = Field(
        description=f"Project name; names the run and cache directories, so it is one directory name: {PATH_NAME_RULE}."
    )
    experiment_name: PathName = Field(
        description=f"Experiment name; names the run and cache directories, so it is one "
        f"directory name: {PATH_NAME_RULE}."
    )
    mode: str = Field(
        description="Trainer mode: sync (generate, then train), one_step_off (generate the next batch while training "
        "on this one), colocate_async or separate_async (verl's V1: a replay buffer between a continuous "
        "rollout and the trainer), or a registered mode. The same setting as trainer.v1.trainer_mode; "
        "null = that one's, or sync."
    )
    nnodes: int = Field(ge=1, description="Nodes of the training pool (actor, ref, critic).")
    n_gpus_per_node: int = Field(ge=0, description="GPUs per node of the training pool; 0 = CPU.")
    n_cpu_ranks_per_node: int = Field(
        ge=1, description="Training ranks per node when the training pool is on CPUs (trainer.n_gpus_per_node=0)."
    )
    total_epochs: int = Field(
        ge=1, description="Passes over the train set (unless total_training_steps stops earlier)."
    )
    total_training_steps: int | None = Field(ge=1, description="Steps to run; null = total_epochs x steps per epoch.")
    test_freq: int = Field(ge=-1, description="Validate every N steps (and after the last); -1 or 0 = never.")
    save_freq: int = Field(ge=-1, description="Checkpoint every N steps (and after the last); -1 or 0 = never.")
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        description="auto: resume from the newest complete checkpoint in default_local_dir; disable: start fresh; "
        "resume_path: resume from resume_from_path."
    )
    resume_from_path: str | None = Field(description="A global_step_N checkpoint directory (resume_mode=resume_path).")
    val_before_train: bool = Field(description="Validate once before the first step (when test_freq > 0).")
    default_local_dir: str = Field(description="Run directory: metrics.jsonl, TensorBoard events, checkpoints.")
    logger: list[str] = Field(description="Where metrics go besides metrics.jsonl: console, tensorboard.")
    task_run_tags: bool = Field(
        description="Tag every stage's task run (stage:, kind:, mode:, experiment:) for the Prefect UI's tag filters. "
        "Off by default: Prefect asks its server for tag concurrency slots before each tagged task "
        "run, a database write that stalls the step for seconds on a busy SQLite server "
        "(docs/ui.md). Task-run names carry the stage and step either way."
    )
    nonfinite: Literal["fail", "skip"] = Field(
        description="A non-finite reward, advantage, loss or gradient norm: fail (stop the run, naming the sample, "
        "step and stage where it arose) or skip (drop that step's update with a warning and count it in "
        "training/nonfinite_skipped); a run whose every update was skipped never ends as a success."
    )
    run_dir_busy: Literal["fail", "wait"] = Field(
        description="Another live run owns default_local_dir: fail at start naming the owner, or wait for it to end."
    )
    run_dir_wait_s: float | None = Field(
        gt=0, description="trainer.run_dir_busy=wait: give up after this many seconds; null = wait as long as it takes."
    )
    v1: TrainerV1Config

    @field_validator("logger")
    @classmethod
    def _known_loggers(cls, names: list[str]) -> list[str]:
        """Each name picks a metrics writer; refused here, with the other keys, rather than ignored."""
        unknown = [name for name in names if name not in LOGGERS]
        if unknown:
            raise PydanticCustomError(
                "unknown_logger",
                "unknown logger {unknown}; choose from {choices}",
                {"unknown": ", ".join(map(repr, unknown)), "choices": ", ".join(LOGGERS)},
            )
        return names


class RolloutPoolConfig(Section):
    """The rollout's own resource pool (verl's one-step-off ``rollout.*`` keys)."""

    nnodes: int = Field(ge=1, description="Nodes of the rollout pool.")
    n_gpus_per_node: int = Field(ge=0, description="GPUs per node of the rollout pool; 0 = CPU.")


class RayConfig(Section):
    address: str | None = Field(
        description="Ray cluster to join (or env RAY_ADDRESS); null = start a local Ray inside the run."
    )
    num_cpus: int | None = Field(
        ge=1, description="CPUs of the local Ray (a whole number, as ray.init takes); null = enough for every role."
    )


class SkipStageConfig(Section):
    """verl's SkipManager role config: cache (or repeat) a stage's result per training step. Every
    ``skip.<stage>`` section takes its defaults from ``skip.rollout`` in ``ppo_trainer.yaml``."""

    enable: bool = Field(description="Turn caching of this stage on.")
    dump_dir: str = Field(description="Cache root, any fsspec URL (`~` expanded).")
    steps: list[Annotated[int, Field(ge=1)]] = Field(
        description="Training steps (from 1) whose result may be loaded or dumped (for skip.async_rollout: feed "
        "indexes of prompts, from 1)."
    )
    action: Literal["cache", "repeat"] = Field(
        description="cache = this step's own dump; repeat = the nearest dumped step."
    )
    storage_options: dict = Field(description="fsspec options (endpoint; never credentials) for dump_dir.")
    allow_mismatch: bool = Field(
        description="Replay entries recorded with other sampling settings, model or tokenizer "
        "(a deliberate cross-config replay); the differences are still logged."
    )
    timeout_s: float = Field(
        gt=0,
        description="A storage call that takes longer is abandoned (the stage is computed "
        "instead, with a warning); a stall is reported while it lasts.",
    )
    retries: int = Field(ge=0, description="Retries of a failed cache write (with backoff) before it is given up.")


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
        """Whether a reference worker runs: only when a KL term needs reference log-probs."""
        return self.actor_rollout_ref.actor.use_kl_loss or self.algorithm.use_kl_in_reward

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
        """Whether the actor's worker also serves generation (``actor_rollout_ref.hybrid_engine``, resolved). null
        resolves to True only for a sync, hf, object_store run with actor and rollout on the same kind of device
        and one training rank (``data_parallel_size`` = 1): a sharded actor cannot generate on each rank
        independently."""
        arr = self.actor_rollout_ref
        if arr.hybrid_engine is not None:
            return arr.hybrid_engine
        return (
            self.data_parallel_size == 1
            and self.trainer.mode == "sync"
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
    def gen_batch_size(self) -> int:
        """Prompts per generation (verl: gen_batch_size, else train_batch_size)."""
        return self.data.gen_batch_size or self.data.train_batch_size
