"""The rollout (``actor_rollout_ref.rollout``): engine, sampling, weight sync, the rollout service's agent
loops and tools; the ``actor_rollout_ref`` section holding it and the roles; the rollout's own pool.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ppoflow.configs.modes import on_policy_modes
from ppoflow.configs.schema_base import ResourcesConfig, Section, Seed
from ppoflow.configs.schema_models import ActorConfig, ModelConfig, RefConfig
from ppoflow.configs.schema_profiler import ProfilerConfig


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


class GatewayConfig(Section):
    """The rollout service's OpenAI-compatible endpoint (docs/gateway.md)."""

    enable: bool = Field(
        description="Serve /v1/chat/completions, /v1/completions and /v1/models from each agent-loop worker."
    )
    host: str = Field(min_length=1, description="Address the gateway binds (127.0.0.1: this machine only).")
    port: int = Field(
        ge=0, le=65535, description="Port the gateway binds; 0 = a free one per agent worker (else one worker only)."
    )


class AgentFunctionConfig(Section):
    """The ``openai_agent`` loop's agent: ``async def agent(client, row, **kwargs)`` (docs/gateway.md)."""

    path: str | None = Field(description="`module:function`, `module`, or a .py file; null = none.")
    name: str | None = Field(description="Function name when `path` names a module or file.")
    kwargs: dict[str, Any] = Field(description="Extra keyword arguments of every call.")
    max_concurrency: int = Field(ge=1, description="Trajectories one agent worker runs at once at most.")
    timeout_s: float = Field(gt=0, description="Seconds one trajectory may take; past it, it fails.")


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
    gateway: GatewayConfig
    agent_function: AgentFunctionConfig


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
        description="sync: one worker generates each batch in one call (a finished response leaves the batch); "
        "async: the rollout service - num_replicas replicas serving per-request generation with continuous batching, "
        "called by agent loops per sample and per turn (multi-turn, tools)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        description="Dtype the rollout samples in (verl's key): its copy of the policy, a colocated actor's weights "
        "cast for each generation, or vLLM's; the actor still trains and computes old log-probs in model.dtype. "
        "null = the dtype that samples fast on the hardware: bfloat16 on GPUs (verl's default) and on CPUs that "
        "multiply it on AMX, float32 on other CPUs (AVX512-BF16 included: bfloat16 samples slower there, "
        "docs/benchmarks.md, ninth run); the run's start says which, and the step cache keeps it."
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
    log_prob_use_dynamic_bsz: bool = Field(
        description="Cut the actor's old-log-prob forward into micro-batches of at most "
        "log_prob_max_token_len_per_gpu real tokens instead of log_prob_micro_batch_size_per_gpu rows."
    )
    log_prob_max_token_len_per_gpu: int = Field(
        ge=1, description="log_prob_use_dynamic_bsz: real tokens per old-log-prob micro-batch at most."
    )
    gpu_memory_utilization: float = Field(gt=0, le=1, description="vLLM: fraction of GPU memory for the engine.")
    tensor_model_parallel_size: int = Field(ge=1, description="vLLM: tensor-parallel degree.")
    val_kwargs: ValSamplingConfig
    weight_sync: WeightSyncConfig
    agent: AgentConfig
    multi_turn: MultiTurnConfig
    profiler: ProfilerConfig
    resources: ResourcesConfig


class ActorRolloutRefConfig(Section):
    hybrid_engine: bool | None = Field(
        description="Colocate (verl's hybrid engine): every actor rank also hosts a rollout engine that samples "
        "its share of the prompts with the weights it trains (gathered from its FSDP2 shards in process) and sleeps, "
        "its memory freed, while the ranks train; with rollout.mode=async the ranks' engines are the rollout "
        f"service's replicas. null = wherever that works ({on_policy_modes()}, rollout.name=hf, "
        "rollout.mode=sync, weight_sync.backend=object_store, actor and rollout on the same kind of device). "
        "Colocated, the rollout runs on the actor's resources; rollout.resources and num_replicas are unused."
    )
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutConfig


class RolloutPoolConfig(Section):
    """The rollout's own resource pool (verl's one-step-off ``rollout.*`` keys)."""

    nnodes: int = Field(ge=1, description="Nodes of the rollout pool.")
    n_gpus_per_node: int = Field(ge=0, description="GPUs per node of the rollout pool; 0 = CPU.")
