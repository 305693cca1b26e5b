"""The typed schema of a ppoflow run configuration.

Defaults live in ``configs/ppo_trainer.yaml`` (one place); this module says what each key means and
which values are legal. Every model forbids unknown keys and is strict (no ``"yes"`` -> ``True``, no
``True`` inside a list of ints), so a typo fails before any worker starts. Rules that relate several
keys live in :func:`cross_field_errors`. Key names follow verl's ``ppo_trainer.yaml`` wherever the
concept exists.
"""

from __future__ import annotations

import os
import re
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

STAGES_WITH_SKIP = ("rollout", "async_rollout", "reward", "old_log_prob", "ref", "values", "advantage")
"""Stage names accepted under ``skip.``: ``rollout`` is verl's; the others extend its idea."""

LOGGERS = ("console", "tensorboard")

SECRET_OPTION = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)
"""fsspec option names that carry credentials (s3fs: key, secret, token)."""


class Section(BaseModel):
    """Base of every config section: strict types, unknown keys rejected, immutable once built."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ----------------------------------------------------------------------------------------- data


class SyntheticDataConfig(Section):
    """Built-in synthetic task; when set, missing ``train_files``/``val_files`` are generated from it."""

    task: Literal["copy"] = Field("copy", description="Synthetic task: `copy` = repeat the prompt's digits, then stop.")
    digits: int = Field(2, ge=1, le=8, description="Digits per prompt.")
    train_rows: int = Field(3200, ge=1, description="Rows written to the train file.")
    val_rows: int = Field(100, ge=1, description="Rows written to the validation file.")
    seed: int = Field(0, description="Seed of the generated rows.")


class DataConfig(Section):
    """Prompts: verl-style parquet/JSONL rows (`prompt`, `data_source`, `reward_model.ground_truth`)."""

    train_files: Union[str, list[str]] = Field(description="Parquet or JSONL file(s), any fsspec URL.")
    val_files: Optional[Union[str, list[str]]] = Field(description="Validation file(s); needed when `trainer.test_freq` > 0.")
    prompt_key: str = Field(description="Column holding the prompt (chat messages or text).")
    train_batch_size: int = Field(ge=1, description="Prompts per training step.")
    gen_batch_size: Optional[int] = Field(ge=1, description="Prompts per generation; null = train_batch_size (names the cache directory).")
    val_batch_size: Optional[int] = Field(ge=1, description="Prompts per validation generation; null = the whole validation set.")
    max_prompt_length: int = Field(ge=1, description="Longest prompt in tokens.")
    max_response_length: int = Field(ge=1, description="Most tokens generated per response.")
    filter_overlong_prompts: bool = Field(description="Drop prompts longer than max_prompt_length instead of applying `truncation`.")
    truncation: Literal["error", "left", "right"] = Field(description="What to do with an overlong prompt that is not filtered.")
    seed: int = Field(description="Seed of the dataloader's shuffle.")
    shuffle: bool = Field(description="Shuffle the train set every epoch.")
    synthetic: Optional[SyntheticDataConfig] = Field(description="Generate the data files from a built-in task when they are missing.")


# ---------------------------------------------------------------------------------------- models


class TinyModelConfig(Section):
    """A random-init Llama with a character tokenizer, built into `model.path` when it holds no model."""

    hidden_size: int = Field(128, ge=8, description="Llama hidden size.")
    intermediate_size: int = Field(256, ge=8, description="Llama MLP size.")
    num_hidden_layers: int = Field(2, ge=1, description="Llama layers.")
    num_attention_heads: int = Field(4, ge=1, description="Attention heads (must divide hidden_size).")
    max_position_embeddings: int = Field(64, ge=8, description="Longest prompt + response the model accepts.")
    seed: int = Field(0, description="Seed of the random initialisation.")


class ModelConfig(Section):
    path: str = Field(description="Hugging Face causal-LM directory (local path or fsspec URL).")
    tokenizer_path: Optional[str] = Field(description="Tokenizer directory; null = `path`.")
    trust_remote_code: bool = Field(description="Passed to transformers' from_pretrained.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="Parameter dtype of the loaded model.")
    build: Optional[TinyModelConfig] = Field(description="Build a tiny model into `path` when it holds none (demo and tests).")


class ResourcesConfig(Section):
    """What one Ray actor of a role reserves, and how many torch threads it uses."""

    num_cpus: float = Field(ge=0, description="Ray CPUs reserved by the role's actor.")
    num_gpus: float = Field(ge=0, description="Ray GPUs reserved by the role's actor.")
    num_threads: int = Field(ge=1, description="torch.set_num_threads inside the actor.")


class OptimConfig(Section):
    lr: float = Field(gt=0, description="AdamW learning rate.")
    betas: list[float] = Field(min_length=2, max_length=2, description="AdamW betas.")
    weight_decay: float = Field(ge=0, description="AdamW weight decay.")
    lr_warmup_steps: int = Field(ge=0, description="Linear warm-up of the learning rate over this many updates.")


class ActorConfig(Section):
    ppo_mini_batch_size: int = Field(ge=1, description="Prompts per optimizer step (times rollout.n trajectories).")
    ppo_micro_batch_size_per_gpu: Optional[int] = Field(ge=1, description="Trajectories per forward/backward; null = whole mini-batch.")
    ppo_epochs: int = Field(ge=1, description="Passes over the step's batch.")
    shuffle: bool = Field(description="Shuffle trajectories between mini-batches.")
    clip_ratio_low: float = Field(ge=0, description="PPO clip: lower bound 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(ge=0, description="PPO clip: upper bound 1 + clip_ratio_high (DAPO clip-higher when larger).")
    clip_ratio_c: float = Field(gt=1, description="Dual-clip constant for negative advantages.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        description="How per-token losses are reduced.")
    entropy_coeff: float = Field(ge=0, description="Entropy bonus coefficient.")
    use_kl_loss: bool = Field(description="Add a KL-to-reference loss (needs the ref worker).")
    kl_loss_coef: float = Field(ge=0, description="Coefficient of the KL loss.")
    kl_loss_type: str = Field(description="KL estimator of the KL loss: kl|abs|mse|low_var_kl (k1/k2/k3, `+` suffix = k2 gradient).")
    grad_clip: float = Field(gt=0, description="Gradient-norm clip.")
    optim: OptimConfig
    resources: ResourcesConfig


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: Optional[int] = Field(ge=1, description="Trajectories per reference forward; null = all.")
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
                    "a Ray collective group broadcasting buckets between the actor and the rollout (GPUs / CPUs).")
    bucket_mb: int = Field(ge=1, description="Tensors are packed into flat buckets of at most this many MiB.")
    delta: bool = Field(description="Send only the tensors that changed since the last sync.")


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field(description="Generation engine: `hf` (transformers/torch, CPU or GPU) or `vllm` (GPU).")
    n: int = Field(ge=1, description="Responses sampled per prompt (the GRPO group size).")
    temperature: float = Field(ge=0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(ge=-1, description="Top-k sampling; -1 or 0 = off.")
    do_sample: bool = Field(description="false = greedy decoding.")
    seed: int = Field(description="Base seed of the rollout sampler (mixed with the step).")
    log_prob_micro_batch_size_per_gpu: Optional[int] = Field(ge=1, description="Trajectories per old-log-prob forward; null = all.")
    gpu_memory_utilization: float = Field(gt=0, le=1, description="vLLM: fraction of GPU memory for the engine.")
    tensor_model_parallel_size: int = Field(ge=1, description="vLLM: tensor-parallel degree.")
    val_kwargs: ValSamplingConfig
    weight_sync: WeightSyncConfig
    resources: ResourcesConfig


class ActorRolloutRefConfig(Section):
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig


class CriticConfig(Section):
    enable: Optional[bool] = Field(description="Run a critic; null = only when algorithm.adv_estimator needs one (gae).")
    model: ModelConfig
    ppo_mini_batch_size: int = Field(ge=1, description="Prompts per critic optimizer step (times rollout.n).")
    ppo_micro_batch_size_per_gpu: Optional[int] = Field(ge=1, description="Trajectories per critic forward/backward; null = whole mini-batch.")
    forward_micro_batch_size_per_gpu: Optional[int] = Field(ge=1, description="Trajectories per value forward; null = all.")
    ppo_epochs: int = Field(ge=1, description="Critic passes over the step's batch.")
    shuffle: bool = Field(description="Shuffle trajectories between critic mini-batches.")
    cliprange_value: float = Field(gt=0, description="Value clipping range around the old values.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        description="How per-token value losses are reduced.")
    grad_clip: float = Field(gt=0, description="Critic gradient-norm clip.")
    optim: OptimConfig
    resources: ResourcesConfig


# ------------------------------------------------------------------------------ reward, algorithm


class CustomRewardConfig(Section):
    path: Optional[str] = Field(description="`module:function`, `module`, or a .py file; null = built-in scorers by data_source.")
    name: str = Field(description="Function name when `path` names a module or file.")


class RewardModelConfig(Section):
    """Where rule-based scoring runs (verl's ``reward_model.reward_manager``)."""

    reward_manager: Literal["naive", "ray"] = Field(
        description="naive: score in the flow; ray: score chunks as Prefect tasks on Ray workers (prefect-ray), "
                    "for slow scorers (sandboxed code, remote judges). ray needs PREFECT_API_URL.")
    num_workers: int = Field(ge=1, description="reward_manager=ray: chunks scored at once.")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(description="In-reward KL coefficient controller.")
    kl_coef: float = Field(ge=0, description="(Initial) KL coefficient.")
    horizon: int = Field(gt=0, description="Adaptive controller horizon.")
    target_kl: float = Field(gt=0, description="Adaptive controller target KL.")


class RolloutCorrectionConfig(Section):
    """verl's off-policy correction between the rollout's sampling log-probs and the trainer's."""

    bypass_mode: bool = Field(description="Use the rollout's log-probs as old log-probs and skip the old_log_prob stage.")
    rollout_is: Optional[Literal["token", "sequence"]] = Field(
        description="Importance-sampling weights old/rollout per token or per sequence; null = none.")
    rollout_is_threshold: Union[float, str] = Field(
        description="Truncate IS weights at this value, or \"lo_hi\" (e.g. \"0.5_2.0\") to zero weights outside [lo, hi] (IcePop).")
    rollout_is_batch_normalize: bool = Field(description="Normalise IS weights to mean 1 over the batch.")
    rollout_rs: Optional[str] = Field(
        description="Rejection sampling: comma list of token_k1|k2|k3, seq_sum_*, seq_mean_*, seq_max_k2|k3; null = none.")
    rollout_rs_threshold: Optional[Union[float, str, list[Union[float, str]]]] = Field(
        description="Bound(s) for rollout_rs: one per option or one for all (k1 options take \"lo_hi\").")


class AlgorithmConfig(Section):
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = Field(
        description="Advantage estimator (gae needs a critic).")
    gamma: float = Field(ge=0, le=1, description="Discount factor.")
    lam: float = Field(ge=0, le=1, description="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = Field(description="Divide GRPO advantages by the group std (false = Dr.GRPO).")
    use_kl_in_reward: bool = Field(description="Subtract a KL-to-reference penalty from the token rewards (needs the ref worker).")
    kl_penalty: str = Field(description="KL estimator of the in-reward penalty: kl|abs|mse|low_var_kl.")
    kl_ctrl: KLControlConfig
    rollout_correction: RolloutCorrectionConfig


# ------------------------------------------------------------------------------- trainer, ray, skip


class TrainerConfig(Section):
    project_name: str = Field(min_length=1, description="Project name (run directory, cache directory).")
    experiment_name: str = Field(min_length=1, description="Experiment name (run directory, cache directory).")
    mode: Literal["sync", "one_step_off"] = Field(
        description="sync: generate, then train; one_step_off: generate the next batch while training on this one.")
    nnodes: int = Field(ge=1, description="Nodes of the training pool (actor, ref, critic).")
    n_gpus_per_node: int = Field(ge=0, description="GPUs per node of the training pool; 0 = CPU.")
    total_epochs: int = Field(ge=1, description="Passes over the train set (unless total_training_steps stops earlier).")
    total_training_steps: Optional[int] = Field(ge=1, description="Steps to run; null = total_epochs x steps per epoch.")
    test_freq: int = Field(ge=-1, description="Validate every N steps (and after the last); -1 or 0 = never.")
    save_freq: int = Field(ge=-1, description="Checkpoint every N steps (and after the last); -1 or 0 = never.")
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        description="auto: resume from the newest complete checkpoint in default_local_dir; disable: start fresh; "
                    "resume_path: resume from resume_from_path.")
    resume_from_path: Optional[str] = Field(description="A global_step_N checkpoint directory (resume_mode=resume_path).")
    val_before_train: bool = Field(description="Validate once before the first step (when test_freq > 0).")
    default_local_dir: str = Field(description="Run directory: metrics.jsonl, TensorBoard events, checkpoints.")
    logger: list[str] = Field(description="Where metrics go besides metrics.jsonl: console, tensorboard.")


class RolloutPoolConfig(Section):
    """The rollout's own resource pool (verl's one-step-off ``rollout.*`` keys)."""

    nnodes: int = Field(ge=1, description="Nodes of the rollout pool.")
    n_gpus_per_node: int = Field(ge=0, description="GPUs per node of the rollout pool; 0 = CPU.")


class RayConfig(Section):
    address: Optional[str] = Field(description="Ray cluster to join (or env RAY_ADDRESS); null = start a local Ray inside the run.")
    num_cpus: Optional[float] = Field(ge=1, description="CPUs of the local Ray; null = enough for every role.")


class SkipStageConfig(Section):
    """verl's SkipManager role config: cache (or repeat) a stage's result per training step."""

    enable: bool = Field(False, description="Turn caching of this stage on.")
    dump_dir: str = Field("~/.verl/rollout_dump", description="Cache root, any fsspec URL (`~` expanded).")
    steps: list[int] = Field(default_factory=list, description="Training steps whose result may be loaded or dumped.")
    action: Literal["cache", "repeat"] = Field("cache", description="cache = this step's own dump; repeat = the nearest dumped step.")
    storage_options: dict = Field(default_factory=dict, description="fsspec options (endpoint, credentials) for dump_dir.")


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
        description="Per-stage result caching, keyed by stage name.")

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
    def gen_batch_size(self) -> int:
        """Prompts per generation (verl: gen_batch_size, else train_batch_size)."""
        return self.data.gen_batch_size or self.data.train_batch_size


def cross_field_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """Rules that relate several keys, as ``(key, message)`` pairs; empty when the config is coherent."""
    from tasks.algorithms.kl import KL_PENALTY_KINDS

    errors: list[tuple[str, str]] = []
    data, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    trajectories = data.train_batch_size * rollout.n
    mini = actor.ppo_mini_batch_size * rollout.n
    if trajectories % mini:
        errors.append(("actor_rollout_ref.actor.ppo_mini_batch_size",
                       f"data.train_batch_size * rollout.n = {trajectories} trajectories is not divisible by "
                       f"ppo_mini_batch_size * rollout.n = {mini}"))
    if actor.ppo_micro_batch_size_per_gpu and mini % actor.ppo_micro_batch_size_per_gpu:
        errors.append(("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                       f"{actor.ppo_micro_batch_size_per_gpu} does not divide the mini-batch of {mini} trajectories"))
    if cfg.use_critic:
        critic_mini = cfg.critic.ppo_mini_batch_size * rollout.n
        if trajectories % critic_mini:
            errors.append(("critic.ppo_mini_batch_size",
                           f"{trajectories} trajectories per step are not divisible by critic mini-batch {critic_mini}"))
        if cfg.critic.ppo_micro_batch_size_per_gpu and critic_mini % cfg.critic.ppo_micro_batch_size_per_gpu:
            errors.append(("critic.ppo_micro_batch_size_per_gpu",
                           f"{cfg.critic.ppo_micro_batch_size_per_gpu} does not divide the critic mini-batch of {critic_mini}"))
    if data.gen_batch_size is not None and data.gen_batch_size != data.train_batch_size:
        errors.append(("data.gen_batch_size",
                       f"{data.gen_batch_size} != data.train_batch_size {data.train_batch_size}: dynamic sampling "
                       "(generating more prompts than are trained on) is not supported; leave it null"))
    if cfg.algorithm.adv_estimator == "gae" and not cfg.use_critic:
        errors.append(("critic.enable", "algorithm.adv_estimator=gae needs a critic; set critic.enable=true or null"))
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and rollout.n < 2:
        errors.append(("actor_rollout_ref.rollout.n",
                       f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses of one prompt "
                       f"and needs n >= 2, got {rollout.n}"))
    for key, kind in (("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type),
                      ("algorithm.kl_penalty", cfg.algorithm.kl_penalty)):
        if kind not in KL_PENALTY_KINDS:
            errors.append((key, f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_PENALTY_KINDS)}"))
    if cfg.trainer.resume_mode == "resume_path" and not re.search(r"global_step_\d+/?$", cfg.trainer.resume_from_path or ""):
        errors.append(("trainer.resume_from_path", f"resume_mode=resume_path needs a .../global_step_N directory, "
                       f"got {cfg.trainer.resume_from_path!r}"))
    if cfg.trainer.test_freq > 0 and data.val_files is None:
        errors.append(("data.val_files", f"trainer.test_freq={cfg.trainer.test_freq} needs validation files"))
    for name in cfg.trainer.logger:
        if name not in LOGGERS:
            errors.append(("trainer.logger", f"unknown logger {name!r}; choose from {', '.join(LOGGERS)}"))
    stage_runs = {"ref": cfg.use_reference, "values": cfg.use_critic}
    for stage, skip in cfg.skip.items():
        if not skip.enable:
            continue
        if not skip.steps:
            errors.append((f"skip.{stage}.steps", "caching is enabled but no step is listed"))
        if not stage_runs.get(stage, True):
            errors.append((f"skip.{stage}.enable", f"this run has no {stage} stage to cache"))
        secrets = sorted(key for key in skip.storage_options if SECRET_OPTION.search(key))
        if secrets:
            errors.append((f"skip.{stage}.storage_options", f"holds credentials {secrets}; configs are stored in "
                           "Prefect run parameters, so pass credentials through the environment (e.g. "
                           "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or an instance role instead"))
    errors += _resource_errors(cfg) + _correction_errors(cfg)
    if (cfg.skip.get("advantage") and cfg.skip["advantage"].enable and cfg.algorithm.use_kl_in_reward
            and cfg.algorithm.kl_ctrl.type == "adaptive"):
        errors.append(("skip.advantage.enable", "a replayed advantage cannot replay the adaptive KL controller's "
                       "update; use algorithm.kl_ctrl.type=fixed or leave skip.advantage off"))
    if rollout.name == "vllm":
        errors += _vllm_errors(cfg)
    return errors


VLLM_MIN_VERSION = "0.10.2"
"""Oldest vLLM the vllm engine runs on: its ``logprobs_mode`` engine argument (log-probs after temperature
scaling, see :mod:`workers.vllm_rollout`) first shipped in 0.10.2."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, or None; reads package metadata only (importing vllm is slow)."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def vllm_version_supported(version: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release >= Version(VLLM_MIN_VERSION).release
    except InvalidVersion:
        return True  # an unusual local build: let the engine itself decide


def _vllm_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``rollout.name=vllm`` needs vLLM installed, a CUDA GPU here and GPUs reserved for the rollout."""
    import torch

    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.rollout"
    errors: list[tuple[str, str]] = []
    # Joining a Ray cluster, the engine runs on its GPU nodes: this machine (the driver) needs neither.
    local = not (cfg.ray.address or os.environ.get("RAY_ADDRESS"))
    version = installed_vllm_version() if local else VLLM_MIN_VERSION
    if version is None:
        errors.append((f"{key}.name", "vllm is not installed; install the optional extra (pip install "
                       "'ppoflow[vllm]') on a CUDA machine, or use actor_rollout_ref.rollout.name=hf"))
    elif not vllm_version_supported(version):
        errors.append((f"{key}.name", f"vllm {version} is installed but rollout.name=vllm needs "
                       f"vllm>={VLLM_MIN_VERSION} (logprobs_mode); upgrade it or use rollout.name=hf"))
    if local and not torch.cuda.is_available():
        errors.append((f"{key}.name", "vllm generates on CUDA GPUs but torch.cuda.is_available() is false on "
                       "this machine; use actor_rollout_ref.rollout.name=hf"))
    gpus, tp = rollout.resources.num_gpus, rollout.tensor_model_parallel_size
    if gpus == 0:
        errors.append((f"{key}.resources.num_gpus", "rollout.name=vllm runs on GPUs; reserve them with "
                       f"{key}.resources.num_gpus > 0 (= tensor_model_parallel_size), or use rollout.name=hf"))
    elif tp > 1 and gpus < tp:
        errors.append((f"{key}.tensor_model_parallel_size", f"{tp} GPUs of tensor parallelism but the rollout "
                       f"worker reserves {key}.resources.num_gpus={gpus:g}"))
    if rollout.weight_sync.backend != "object_store":
        errors.append((f"{key}.weight_sync.backend", f"{rollout.weight_sync.backend} is not supported with "
                       "rollout.name=vllm (the engine's GPU workers are outside the Ray collective group); "
                       "use object_store"))
    return errors


def _resource_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """verl's pool rules: training roles fit the trainer pool, the rollout fits its own pool."""
    errors: list[tuple[str, str]] = []
    arr = cfg.actor_rollout_ref
    trainer_gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rollout_gpus = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    training_roles = {"actor_rollout_ref.actor": arr.actor.resources}
    if cfg.use_reference:
        training_roles["actor_rollout_ref.ref"] = arr.ref.resources
    if cfg.use_critic:
        training_roles["critic"] = cfg.critic.resources
    wanted = sum(resources.num_gpus for resources in training_roles.values())
    if wanted > trainer_gpus:
        errors.append(("trainer.n_gpus_per_node", f"the training roles reserve {wanted:g} GPUs "
                       f"({', '.join(f'{k}.resources.num_gpus={r.num_gpus:g}' for k, r in training_roles.items())}) "
                       f"but the training pool has trainer.nnodes * trainer.n_gpus_per_node = {trainer_gpus}"))
    if arr.rollout.resources.num_gpus > rollout_gpus:
        errors.append(("rollout.n_gpus_per_node", f"actor_rollout_ref.rollout.resources.num_gpus="
                       f"{arr.rollout.resources.num_gpus:g} exceeds the rollout pool rollout.nnodes * "
                       f"rollout.n_gpus_per_node = {rollout_gpus}"))
    if trainer_gpus and trainer_gpus % arr.rollout.n and (arr.rollout.n * cfg.data.train_batch_size) % trainer_gpus:
        errors.append(("actor_rollout_ref.rollout.n", f"with {trainer_gpus} training GPUs, rollout.n={arr.rollout.n} "
                       "must divide the GPU count, or rollout.n * data.train_batch_size must be divisible by it"))
    if cfg.trainer.mode == "one_step_off" and (trainer_gpus > 0) != (rollout_gpus > 0):
        errors.append(("rollout.n_gpus_per_node", "one_step_off needs both pools on GPUs or both on CPUs "
                       f"(training pool {trainer_gpus} GPUs, rollout pool {rollout_gpus})"))
    if arr.rollout.weight_sync.backend == "nccl" and not (arr.actor.resources.num_gpus and arr.rollout.resources.num_gpus):
        errors.append(("actor_rollout_ref.rollout.weight_sync.backend",
                       "nccl moves weights between GPUs; the actor and the rollout both need resources.num_gpus > 0 "
                       "(use object_store or gloo on CPUs)"))
    return errors


def _correction_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """The rollout-correction thresholds parse, and bypass mode is not combined with what it skips."""
    from tasks.algorithms.correction import compute_rejection_mask, parse_is_threshold

    errors: list[tuple[str, str]] = []
    correction = cfg.algorithm.rollout_correction
    key = "algorithm.rollout_correction"
    if correction.rollout_is is not None:
        try:
            parse_is_threshold(correction.rollout_is_threshold)
        except (TypeError, ValueError) as error:
            errors.append((f"{key}.rollout_is_threshold", str(error)))
    if correction.rollout_rs is not None:
        if correction.rollout_rs_threshold is None:
            errors.append((f"{key}.rollout_rs_threshold", f"rollout_rs={correction.rollout_rs!r} needs thresholds"))
        else:
            import torch

            try:  # the real parser on a one-token batch: same messages as at run time
                compute_rejection_mask(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                                       options=correction.rollout_rs, thresholds=correction.rollout_rs_threshold)
            except (TypeError, ValueError) as error:
                errors.append((f"{key}.rollout_rs", str(error)))
    if correction.bypass_mode and (correction.rollout_is or correction.rollout_rs):
        errors.append((f"{key}.bypass_mode", "bypass mode uses the rollout's log-probs as old log-probs, so "
                       "rollout_is / rollout_rs (old vs rollout) have nothing to correct; set bypass_mode=false"))
    return errors
