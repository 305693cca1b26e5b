"""The models and the training roles (``actor_rollout_ref.model``, ``.actor``, ``.ref``, ``critic``): how each
is loaded, sharded over its ranks and trained.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ppoflow.algorithms.names import KL_PENALTY_KINDS, LOSS_AGG_MODES, POLICY_LOSSES
from ppoflow.configs.schema_base import ResourcesConfig, Section, Seed
from ppoflow.configs.schema_profiler import ProfilerConfig


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
    use_remove_padding: bool = Field(
        description="Pack each micro-batch's sequences into one row without pad tokens (position ids restart per "
        "sequence, attention stays inside each) for every forward pass of the model's roles: log-probs, values "
        "and the updates. Flash attention takes a micro-batch in one row; sdpa and eager in rows as wide as its "
        "longest unit, filled first-fit, whose masks cost each row's width squared. A unit is a sequence or, where "
        "the estimate says it costs less, a prompt once followed by the responses of its samples in the "
        "micro-batch (a GRPO group), each response attending to the prompt and to itself."
    )
    build: TinyModelConfig | None = Field(
        description="Build a random-init tiny Llama into `path` when it holds no model (demo and tests), announced on "
        "the console. A recipe belongs to the path it was written for: a `key=value` override of this "
        "model's `path` drops the preset's recipe unless a `build.*` key of the same model is overridden "
        "too (e.g. `build.seed=0`), so a path without a model is an error, never a fresh random model."
    )
    lora_rank: int = Field(
        ge=0,
        description="Rank of the LoRA adapters (peft) trained instead of the whole model; 0 = full fine-tuning "
        "(verl). With LoRA the reference is the base model with the adapter disabled, weight sync sends the "
        "adapter, checkpoints hold it; docs/lora.md.",
    )
    lora_alpha: int = Field(gt=0, description="LoRA scaling: the adapter's update is scaled by lora_alpha / lora_rank.")
    target_modules: str | list[str] = Field(
        description="Modules LoRA adapts: `all-linear` (every linear layer but the output head), a list of module "
        "names (e.g. [q_proj, v_proj]), or a regular expression peft matches against the full module names."
    )
    lora_adapter_path: str | None = Field(
        description="A peft adapter directory (adapter_config.json, e.g. a run's `huggingface/adapter`) to go on "
        "training; set, LoRA is on and the adapter's own rank, alpha and target modules apply (verl)."
    )

    @field_validator("target_modules")
    @classmethod
    def _some_target_modules(cls, modules: str | list[str]) -> str | list[str]:
        if not modules:
            raise PydanticCustomError("no_target_modules", "names no module: give `all-linear` or module names")
        return modules

    @property
    def lora(self) -> bool:
        """Whether LoRA adapters are trained instead of the whole model (verl: ``lora_rank > 0`` or an adapter
        to load)."""
        return self.lora_rank > 0 or self.lora_adapter_path is not None


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
        description="Dtype the gathered parameters compute in (the sharded master copy keeps model.dtype); at one "
        "rank, bfloat16 / float16 run the role's forward and backward passes under torch.autocast while weights, "
        "gradients and optimizer state keep model.dtype. null = compute in the model's dtype, no mixed precision."
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
    profiler: ProfilerConfig


class PPOUpdateConfig(TrainingEngineConfig):
    """What the actor and the critic share: how one step's batch is cut up and trained on."""

    ppo_mini_batch_size: int = Field(ge=1, description="Prompts per optimizer step (times rollout.n trajectories).")
    ppo_micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Trajectories per forward/backward; null = whole mini-batch."
    )
    use_dynamic_bsz: bool = Field(
        description="Cut each mini-batch into micro-batches of at most ppo_max_token_len_per_gpu real tokens "
        "(prompt + response, padding not counted; balanced, Karmarkar-Karp) instead of "
        "ppo_micro_batch_size_per_gpu rows; the critic's value forward too (forward_max_token_len_per_gpu). "
        "With use_remove_padding under sdpa or eager, a prompt's samples stay in one micro-batch where they fit, "
        "for the packed pass to share the prompt."
    )
    ppo_max_token_len_per_gpu: int = Field(
        ge=1,
        description="use_dynamic_bsz: real tokens per update micro-batch at most; at least data.max_prompt_length "
        "+ data.max_response_length.",
    )
    ppo_epochs: int = Field(ge=1, description="Passes over the step's batch.")
    shuffle: bool = Field(description="Shuffle trajectories between mini-batches.")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = Field(description="How per-token losses are reduced.")  # type: ignore[valid-type]
    grad_clip: float = Field(gt=0, description="Gradient-norm clip.")
    optim: OptimConfig
    resources: ResourcesConfig


class PolicyLossConfig(Section):
    """verl's ``actor.policy_loss``: which policy loss the actor trains with, and the covariance losses' settings
    (:mod:`ppoflow.algorithms.policy_losses`)."""

    loss_mode: str = Field(
        description=f"The policy loss: {', '.join(POLICY_LOSSES)}, or one of your own registered with "
        "ppoflow.algorithms.policy_losses.register_policy_loss (loss_module names its file). vanilla: the PPO clip "
        "with dual clip; gspo: the sequence's geometric-mean ratio clipped to [1 - clip_ratio_low, 1 + "
        "clip_ratio_high] (the paper: 3e-4, 4e-4); cispo: the clipped ratio as a detached weight of -A * log p; "
        "geo_mean (GMPO): the geometric mean of the token ratios, each clipped in log space; sapo: a soft gate "
        "(tau_pos, tau_neg) instead of the clip; clip_cov / kl_cov: the PPO clip with the gradient cut, or the "
        "unclipped loss with a |log r| penalty (ppo_kl_coef), on the tokens of high covariance of advantage and "
        "log-prob. gspo and sapo always reduce seq-mean-token-mean, geo_mean per sequence (verl)."
    )
    loss_module: str | None = Field(
        description="A Python file (or importable module) imported before loss_mode is looked up, by the driver "
        "and by the actor's workers: its @register_policy_loss functions become loss modes. Not verl's (verl "
        "registers losses in its own code)."
    )
    clip_cov_ratio: float = Field(
        gt=0, le=1, description="clip_cov: share of a micro-batch's tokens whose gradient is cut (at least one)."
    )
    clip_cov_lb: float = Field(
        description="clip_cov: a token the PPO clip left alone is a candidate when its covariance term "
        "(A - mean A) * (log p - mean log p) lies above this..."
    )
    clip_cov_ub: float = Field(description="clip_cov: ...and below this.")
    kl_cov_ratio: float = Field(
        gt=0,
        le=1,
        description="kl_cov: share of a micro-batch's tokens (the largest covariance terms; at least one) "
        "that take the KL penalty.",
    )
    ppo_kl_coef: float = Field(ge=0, description="kl_cov: coefficient of the |log r| penalty.")

    @field_validator("clip_cov_ub")
    @classmethod
    def _above_lower_bound(cls, upper: float, info: ValidationInfo) -> float:
        lower = info.data.get("clip_cov_lb")  # absent when clip_cov_lb itself was invalid
        if lower is not None and upper <= lower:
            raise PydanticCustomError("clip_cov_bounds", "must be above clip_cov_lb={lower}", {"lower": lower})
        return upper


class ActorConfig(PPOUpdateConfig):
    clip_ratio_low: float = Field(
        gt=0,
        description="PPO clip: lower bound 1 - clip_ratio_low; 1 or more clips nothing from below (verl's CISPO "
        "examples set 10).",
    )
    clip_ratio_high: float = Field(
        gt=0, description="PPO clip: upper bound 1 + clip_ratio_high (DAPO clip-higher when larger)."
    )
    clip_ratio_c: float = Field(gt=1, description="Dual-clip constant for negative advantages.")
    policy_loss: PolicyLossConfig
    tau_pos: float = Field(gt=0, description="sapo: temperature of the soft gate where the advantage is positive.")
    tau_neg: float = Field(gt=0, description="sapo: temperature of the soft gate where it is not.")
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
    log_prob_use_dynamic_bsz: bool = Field(
        description="Cut the reference forward into micro-batches of at most log_prob_max_token_len_per_gpu real "
        "tokens instead of log_prob_micro_batch_size_per_gpu rows."
    )
    log_prob_max_token_len_per_gpu: int = Field(
        ge=1, description="log_prob_use_dynamic_bsz: real tokens per reference micro-batch at most."
    )
    resources: ResourcesConfig


class CriticConfig(PPOUpdateConfig):
    enable: bool | None = Field(description="Run a critic; null = only when algorithm.adv_estimator needs one (gae).")
    model: ModelConfig
    forward_micro_batch_size_per_gpu: int | None = Field(
        ge=1, description="Trajectories per value forward; null = all."
    )
    forward_max_token_len_per_gpu: int = Field(
        ge=1, description="use_dynamic_bsz: real tokens per value-forward micro-batch at most."
    )
    cliprange_value: float = Field(gt=0, description="Value clipping range around the old values.")
