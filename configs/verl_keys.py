"""verl's config keys that ppoflow spells differently or does not have, so "did you mean" answers by meaning.

The closest spelling misleads a verl user: ``actor.clip_ratio`` (verl's symmetric PPO clip) is not the dual-clip
constant ``clip_ratio_c``, and ``trainer.device`` is not a key: the resources place each role.
:data:`RENAMED` maps a key of verl's ``ppo_trainer.yaml`` to the key (or keys) holding the same setting here;
:data:`UNSUPPORTED` says why a verl key has no counterpart. An entry may name a section: every key under it
gets that answer. The config loader asks :func:`~ppoflow.configs.verl_answers.verl_answer` for every unknown key
before it falls back to difflib for plain typos; tests/test_verl_keys.py checks that each target is a key of the
schema.
"""

from __future__ import annotations

ACTOR, REF, ROLLOUT, MODEL = (f"actor_rollout_ref.{role}" for role in ("actor", "ref", "rollout", "model"))

FSDP1_OFFLOAD = ("param_offload", "optimizer_offload")
CRITIC_FSDP = ("critic.fsdp", "critic.model.fsdp_config")
"""Where verl's critic keeps its FSDP engine settings (older and newer layouts); ours: critic.fsdp_config."""
"""verl's FSDP1-style offload switches; FSDP2's CPUOffloadPolicy (``fsdp_config.offload_policy``) moves
parameters, gradients and optimizer state together."""

RENAMED: dict[str, str | tuple[str, ...]] = {
    # data
    "data.tokenizer": f"{MODEL}.tokenizer_path",
    "data.trust_remote_code": f"{MODEL}.trust_remote_code",
    "data.tool_config_path": f"{ROLLOUT}.multi_turn.tool_config_path",
    # actor, ref and critic: the same concepts under each role
    **{
        f"{role}.fsdp_config.{offload}": f"{role}.fsdp_config.offload_policy"
        for role in (ACTOR, REF)
        for offload in FSDP1_OFFLOAD
    },
    **{
        f"critic.{section}.{offload}": "critic.fsdp_config.offload_policy"
        for section in ("fsdp", "model.fsdp_config")
        for offload in (*FSDP1_OFFLOAD, "offload_policy")
    },
    **{f"{section}.reshard_after_forward": "critic.fsdp_config.reshard_after_forward" for section in CRITIC_FSDP},
    **{f"{role}.fsdp_config.strategy": f"{role}.strategy" for role in (ACTOR, REF)},
    **{f"{section}.strategy": "critic.strategy" for section in CRITIC_FSDP},
    **{f"{role}.fsdp_config.model_dtype": f"{MODEL}.dtype" for role in (ACTOR, REF)},
    **{f"{section}.model_dtype": "critic.model.dtype" for section in CRITIC_FSDP},
    # verl's engine ``dtype`` is the compute dtype of mixed precision
    **{f"{role}.fsdp_config.dtype": f"{role}.fsdp_config.mixed_precision.param_dtype" for role in (ACTOR, REF)},
    **{f"{section}.dtype": "critic.fsdp_config.mixed_precision.param_dtype" for section in CRITIC_FSDP},
    f"{ACTOR}.use_remove_padding": f"{MODEL}.use_remove_padding",
    f"{ACTOR}.optim.clip_grad": f"{ACTOR}.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    f"{ACTOR}.ppo_micro_batch_size": f"{ACTOR}.ppo_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "critic.forward_micro_batch_size_per_gpu",
    f"{REF}.log_prob_micro_batch_size": f"{REF}.log_prob_micro_batch_size_per_gpu",
    f"{ROLLOUT}.log_prob_micro_batch_size": f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
    **{f"{role}.rollout_n": f"{ROLLOUT}.n" for role in (ACTOR, REF, "critic")},
    f"{ACTOR}.clip_ratio": (f"{ACTOR}.clip_ratio_low", f"{ACTOR}.clip_ratio_high"),
    # rollout
    f"{ROLLOUT}.prompt_length": "data.max_prompt_length",
    f"{ROLLOUT}.response_length": "data.max_response_length",
    f"{MODEL}.torch_dtype": f"{MODEL}.dtype",
    f"{ROLLOUT}.nnodes": "rollout.nnodes",
    f"{ROLLOUT}.n_gpus_per_node": "rollout.n_gpus_per_node",
    f"{ROLLOUT}.checkpoint_engine.backend": f"{ROLLOUT}.weight_sync.backend",
    f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes": f"{ROLLOUT}.weight_sync.bucket_mb",
    f"{ROLLOUT}.multi_turn.function_tool_path": f"{ROLLOUT}.multi_turn.tool_config_path",
    # reward (verl's newer reward.* layout)
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.reward_manager.name": "reward_model.reward_manager",
    "reward.num_workers": "reward_model.num_workers",
    "reward_manager.name": "reward_model.reward_manager",
    **{  # the DAPO recipe's older layout
        f"reward_model.overlong_buffer.{key}": f"reward_model.reward_kwargs.overlong_buffer_cfg.{key}"
        for key in ("enable", "len", "penalty_factor", "log")
    },
    # verl's fully async entry (trainer.mode=separate_async here)
    "async_training.trigger_parameter_sync_step": "trainer.v1.separate_async.parameter_sync_step",
    "async_training.use_rollout_log_probs": "algorithm.rollout_correction.bypass_mode",
    "async_training.partial_rollout": "trainer.v1.colocate_async.partial_rollout",
    "rollout.total_epochs": "trainer.total_epochs",
    "rollout.test_freq": "trainer.test_freq",
    # ray
    "ray_kwargs.ray_init.num_cpus": "ray.num_cpus",
    # verl's older profiler key
    "trainer.profile_steps": "global_profiler.steps",
}
"""verl key -> the key(s) of the same setting here (several: verl's one key sets them all)."""

_FULLY_ASYNC = "verl's fully async entry is trainer.mode=separate_async here (with rollout.mode=async)"
_NO_SCHEDULE = "not supported: the learning rate rises linearly over optim.lr_warmup_steps, then stays constant"
_NO_PARALLELISM = (
    "not supported: each role is data-parallel over its ranks (FSDP2), with no sequence or model parallelism"
)
_VLLM_ENGINE = "not supported: ppoflow sets the vLLM engine's other arguments itself"
_MEGATRON = "not supported: the training engine is FSDP2 (strategy: fsdp2); there is no Megatron engine"
_ENGINE_TUNING = "not supported: FSDP2 shards each decoder layer over the role's ranks with fixed settings"
_MULTIMODAL = "not supported: prompts are text only"
_KERNELS = "not supported: models run on plain transformers kernels"
_ENTROPY = (
    "not needed: log-probs and entropy always come from one pass over chunks of tokens that keeps only the logits "
    "and recomputes the softmax in the backward pass"
)
_ONE_TOOL = "not supported: the profiler is torch's (global_profiler.tool=torch or torch_memory)"
_PROFILE_ROLES = (ACTOR, REF, ROLLOUT, "critic")
_OPTIMIZER = "not supported: the optimizer is torch's AdamW"
_SCORERS = "not supported: the reward loop is ppoflow's; custom_reward_function.path plugs in a scorer"
_ENGINE_OPTIONS = {
    "fsdp_size": _ENGINE_TUNING,
    "wrap_policy": _ENGINE_TUNING,
    "forward_prefetch": _ENGINE_TUNING,
    "use_orig_params": _ENGINE_TUNING,
    "seed": "not supported: ppoflow seeds the training engine itself (data.seed)",
    "full_determinism": "not supported: torch's deterministic-algorithms mode is not switched on",
    "ulysses_sequence_parallel_size": _NO_PARALLELISM,
    "entropy_from_logits_with_chunking": _ENTROPY,
    "entropy_checkpointing": _ENTROPY,
    "use_torch_compile": "not supported: models run eagerly",
    "forward_only": "not needed: a role without an optimizer (ref) runs forward only",
}
"""The rest of verl's FSDP engine config (``fsdp_config``), for each role's copy of it."""

UNSUPPORTED: dict[str, str] = {
    # data
    "data.reward_fn_key": "not supported: the scorer is chosen by each row's data_source column",
    "data.train_max_samples": "not supported: every row of data.train_files is used; cut the file instead",
    "data.val_max_samples": "not supported: every row of data.val_files is used; cut the file instead",
    "data.dataloader_num_workers": "not supported: the prompts are loaded in the driver, without loader workers",
    "data.filter_overlong_prompts_workers": "not supported: overlong prompts are filtered in the driver",
    "data.validation_shuffle": "not supported: validation prompts are read in file order",
    "data.custom_cls": "not supported: data files are read by ppoflow's parquet / JSONL loader",
    "data.use_shm": "not supported: data files are read through fsspec",
    "data.image_key": _MULTIMODAL,
    "data.video_key": _MULTIMODAL,
    "data.image_patch_size": _MULTIMODAL,
    "data.return_multi_modal_inputs": _MULTIMODAL,
    "data.return_raw_input_ids": "not needed: it is for a reward model's own tokenizer; rewards come from scorers",
    "data.return_full_prompt": "not supported: rows keep the prompt as given; the chat template is applied where "
    "prompts are tokenized",
    "data.sampler": "not supported: train prompts come in data.shuffle / data.seed order (no curriculum sampler)",
    "data.datagen": "not supported: the prompt set is fixed (no dynamic data generation)",
    # model
    f"{MODEL}.use_liger": _KERNELS,
    f"{MODEL}.use_fused_kernels": _KERNELS,
    f"{MODEL}.fused_kernel_options": _KERNELS,
    **{
        f"{model}.{key}": why
        for model in (MODEL, "critic.model")
        for key, why in {
            "exclude_modules": "not supported: target_modules alone says which modules LoRA adapts",
            "enable_activation_offload": "not supported: activations stay on the device",
            "external_lib": "not supported: models load through transformers (trust_remote_code for custom code)",
            "use_shm": "not supported: models are read through fsspec",
            "override_config": "not supported: the model's config is used as saved (model.build sets a built model's)",
            "tiled_mlp": _KERNELS,
        }.items()
    },
    f"{MODEL}.hf_config_path": "not supported: the model's config is read from model.path",
    f"{MODEL}.custom_chat_template": "not supported: prompts use the tokenizer's own chat template",
    **{
        f"{role}.mtp": "not supported: no multi-token prediction (neither training nor speculative decoding)"
        for role in (MODEL, ROLLOUT)
    },
    # actor, ref, critic
    **{f"{role}.use_torch_compile": "not supported: models run eagerly" for role in (ACTOR, REF)},
    f"{ACTOR}.loss_scale_factor": "not supported: loss_agg_mode decides how token losses are reduced",
    **{
        f"{role}.checkpoint": "not supported: a checkpoint always holds the model, optimizer and scheduler state"
        for role in (ACTOR, "critic")
    },
    f"{ACTOR}.freeze_vision_tower": _MULTIMODAL,
    f"{ACTOR}.use_fused_kernels": _KERNELS,
    f"{ACTOR}.calculate_entropy": "not needed: the entropy is always computed (actor/entropy)",
    f"{ACTOR}.use_prefix_grouper": "not supported: each response is forwarded with its own copy of the prompt",
    **{
        f"{ACTOR}.{key}": "not supported: no estimator here uses the sum of squared token probabilities"
        for key in ("calculate_sum_pi_squared", "sum_pi_squared_checkpointing")
    },
    **{f"{role}.{key}": _ENTROPY for role in (ACTOR, REF) for key in _ENGINE_OPTIONS if "entropy" in key},
    **{
        f"{role}.data_loader_seed": "not needed: mini-batches are shuffled with data.seed" for role in (ACTOR, "critic")
    },
    **{
        f"{role}.profiler.{key}": why
        for role in _PROFILE_ROLES
        for key, why in {
            "tool": "not supported: global_profiler.tool sets every role's tool",
            "save_path": "not supported: global_profiler.save_path holds every role's files",
            "tool_config.nsys": _ONE_TOOL,
            "tool_config.npu": _ONE_TOOL,
            "tool_config.torch.discrete": "not supported: one trace per process and step, each stage a "
            "record_function range in it",
            "tool_config.torch_memory": "not supported: global_profiler.global_tool_config.torch_memory sets "
            "every role's",
        }.items()
    },
    **{f"{role}.router_replay": "not supported: no MoE routing replay" for role in (ACTOR, REF)},
    f"{ROLLOUT}.enable_rollout_routing_replay": "not supported: no MoE routing replay",
    "actor_rollout_ref.nccl_timeout": "not supported: torch.distributed's default timeout applies",
    f"{ACTOR}.megatron": _MEGATRON,
    f"{REF}.megatron": _MEGATRON,
    "critic.megatron": _MEGATRON,
    **{f"{role}.ulysses_sequence_parallel_size": _NO_PARALLELISM for role in (ACTOR, REF, "critic")},
    **{
        f"{section}.{option}": why
        for section in (f"{ACTOR}.fsdp_config", f"{REF}.fsdp_config", *CRITIC_FSDP)
        for option, why in _ENGINE_OPTIONS.items()
    },
    **{
        f"{role}.optim.{option}": _NO_SCHEDULE
        for role in (ACTOR, "critic")
        for option in ("lr_warmup_steps_ratio", "warmup_style", "lr_scheduler_type", "min_lr_ratio", "num_cycles")
    },
    **{
        f"{role}.optim.{option}": _OPTIMIZER
        for role in (ACTOR, "critic")
        for option in ("optimizer", "optimizer_impl", "override_optimizer_config")
    },
    **{
        f"{role}.optim.total_training_steps": "not needed: the warm-up counts updates from the start of training"
        for role in (ACTOR, "critic")
    },
    # rollout
    **{
        f"{ROLLOUT}.{option}": _VLLM_ENGINE
        for option in (
            "enforce_eager",
            "free_cache_engine",
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "max_num_batched_tokens",
            "max_model_len",
            "load_format",
            "layered_summon",
            "disable_log_stats",
            "cudagraph_capture_sizes",
            "logprobs_mode",
            "scheduling_policy",
            "multi_stage_wake_up",
            "engine_kwargs",
            "skip_tokenizer_init",
            "quantization",
            "quantization_config_file",
        )
    },
    f"{ROLLOUT}.checkpoint_engine.engine_kwargs": "not supported: the weight sync backend takes no other settings",
    f"{ROLLOUT}.prometheus": "not supported: rollout metrics are in metrics.jsonl",
    f"{ROLLOUT}.trace": "not supported: no rollout tracing backend; each step's generations can be kept with the "
    "step cache (skip.rollout.*)",
    **{
        f"{ROLLOUT}.{key}": "not supported: keep and reuse each step's generations with the step cache (skip.rollout.*)"
        for key in ("skip_rollout", "skip_dump_dir")
    },
    **{
        f"{ROLLOUT}.{option}": "not supported: the vllm engine is split by tensor_model_parallel_size only"
        for option in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size")
    },
    f"{ROLLOUT}.calculate_log_probs": "not needed: the rollout always returns its sampling log-probs",
    f"{ROLLOUT}.ignore_eos": "not supported: a response ends at the tokenizer's end-of-sequence token",
    f"{ROLLOUT}.over_sample_rate": "not supported: every request runs to its end",
    f"{ROLLOUT}.full_determinism": "not supported: rollout.seed seeds the sampler, but engines are not bitwise "
    "deterministic",
    f"{ROLLOUT}.multi_turn.enable": "not needed: multi-turn is the tool_agent loop of the rollout service "
    "(rollout.mode=async, agent.default_agent_loop=tool_agent)",
    f"{ROLLOUT}.multi_turn.max_user_turns": "not supported: a trajectory's turns are bounded by "
    "multi_turn.max_assistant_turns",
    f"{ROLLOUT}.multi_turn.max_parallel_calls": "not supported: a model turn makes one tool call",
    f"{ROLLOUT}.multi_turn.tool_response_truncate_side": "not supported: multi_turn.max_tokens_per_turn bounds "
    "a turn; a tool response is not truncated on its own",
    f"{ROLLOUT}.multi_turn.interaction_config_path": "not supported: no simulated-user interactions; turns "
    "alternate between the model and its tools",
    f"{ROLLOUT}.multi_turn.use_inference_chat_template": "not supported: turns use the tokenizer's own chat template",
    f"{ROLLOUT}.multi_turn.tokenization_sanity_check_mode": "not supported: no re-tokenization check of trajectories",
    f"{ROLLOUT}.multi_turn.num_repeat_rollouts": "not needed: rollout.n sets the trajectories per prompt",
    f"{ROLLOUT}.agent.custom_async_server": "not supported: the replicas are ppoflow's own",
    # algorithm
    **{
        key: "not supported: every trajectory of a batch is trained on (no PF-PPO reweighting)"
        for key in ("algorithm.use_pf_ppo", "algorithm.pf_ppo")
    },
    "algorithm.rollout_correction.loss_type": "not supported: correction weights multiply the PPO loss",
    # reward models
    **{
        f"reward_model.{key}": "not supported: the reward model has a worker of its own, with reward_model.resources"
        for key in ("enable_resource_pool", "n_gpus_per_node", "nnodes")
    },
    "reward_model.strategy": "not supported: the reward model runs plain transformers forward passes",
    "reward_model.micro_batch_size": "not supported: set reward_model.micro_batch_size_per_gpu",
    "reward_model.ulysses_sequence_parallel_size": _NO_PARALLELISM,
    "reward_model.rollout": "not supported: a generative reward model has no server of its own here; use "
    "reward_model.judge (on the policy's rollout replicas) or reward_model.remote.url",
    "reward_model.profiler": "not supported: the profiler records the actor, ref, rollout and critic "
    "(<role>.profiler), not the reward model's worker",
    **{
        f"reward_model.model.{key}": "not needed: the prompt and response are decoded with the policy's "
        "tokenizer and re-tokenised with reward_model.model.tokenizer_path's"
        for key in ("input_tokenizer", "external_lib")
    },
    **{f"reward_model.model.{key}": _ENGINE_TUNING for key in ("fsdp_config", "use_shm", "use_remove_padding")},
    "reward_model.model.override_config": "not supported: the reward model loads with its own config.json",
    "reward_model.model.use_fused_kernels": _KERNELS,
    "reward.reward_model": "not supported: reward_model.* sets the reward model",
    **{
        f"{section}.sandbox_fusion": "not supported: write a scorer (custom_reward_function.path) that calls the "
        "sandbox"
        for section in ("reward", "reward_model")
    },
    **{
        key: _SCORERS
        for key in (
            "reward_model.reward_loop_source",
            "reward_model.reward_loop_module_path",
            "reward_model.reward_loop_class_name",
            "reward_model.use_reward_loop",
            "reward_manager.source",
            "reward_manager.module",
        )
    },
    "reward_model.launch_reward_fn_async": "not supported: reward_model.reward_manager says where scoring runs "
    "(naive: in the flow; ray: on Ray workers)",
    # trainer
    "trainer.device": "not supported: the device follows the resources: trainer.n_gpus_per_node (0 = CPU) and "
    "each role's resources.num_gpus",
    "trainer.use_v1": "not supported: one trainer runs every mode; trainer.mode picks it",
    "trainer.balance_batch": "not supported: training ranks always get equal numbers of trajectories with balanced "
    "tokens (verl's balance_batch=true)",
    "trainer.critic_warmup": "not supported: verl would update only the critic for that many steps; here the actor "
    "trains from the first step",
    "trainer.val_only": "not supported: validation runs within training (trainer.test_freq, trainer.val_before_train)",
    "trainer.default_hdfs_dir": "not supported: trainer.default_local_dir takes any fsspec URL (s3://, hdfs://, ...)",
    "trainer.del_local_ckpt_after_load": "not supported: checkpoints stay where they were written",
    "trainer.max_actor_ckpt_to_keep": "not supported: every checkpoint is kept",
    "trainer.max_critic_ckpt_to_keep": "not supported: every checkpoint is kept",
    "trainer.ray_wait_register_center_timeout": "not supported: the workers are Ray actors started by the flow",
    "trainer.esi_redundant_time": "not supported: checkpoints are saved every trainer.save_freq steps",
    "trainer.use_legacy_worker_impl": "not supported: ppoflow has one worker implementation",
    "trainer.v1.sampler.sync_refill_failed_groups": "not needed: the replay buffer always evicts and "
    "replaces failed prompt groups",
    "trainer.v1.separate_async.hybrid_rollout": "not supported: the trainer's GPUs are not lent to generation",
    # whole sections
    "ray_kwargs.ray_init.runtime_env": "not supported: Ray workers run in the driver's environment "
    "(or the cluster's, with ray.address)",
    "ray_kwargs.timeline_json_file": "not supported: stage timings are in metrics.jsonl (timing_s/*) and the "
    "Prefect UI",
    "global_profiler.profile_continuous_steps": "not supported: each profiled step gets files of its own",
    "global_profiler.global_tool_config.nsys": _ONE_TOOL,
    **{
        f"global_profiler.global_tool_config.torch_memory.{key}": "not supported: torch's own "
        "_record_memory_history takes trace_alloc_max_entries, context and stacks"
        for key in ("stack_depth", "kw_args")
    },
    **{
        f"global_profiler.{key}": "not supported: the traces are written to global_profiler.save_path (any fsspec "
        "URL) as they are made"
        for key in ("relocate_results", "finish_hook_cmd", "finish_hook_all_ranks", "finish_hook_ranks")
    },
    "transfer_queue": "not supported: the async modes' replay buffer is ppoflow's own (trainer.v1.sampler)",
    # verl's fully async entry (verl/experimental/fully_async_policy): trainer.mode=separate_async here
    "async_training.staleness_threshold": f"not supported as a share of samples: {_FULLY_ASYNC}, whose replay buffer "
    "bounds staleness in steps (trainer.v1.sampler.max_off_policy_threshold)",
    "async_training.require_batches": f"not needed: {_FULLY_ASYNC}, which trains on data.train_batch_size prompts a "
    "step (verl's require_batches x ppo_mini_batch_size x trigger_parameter_sync_step)",
    "async_training.compute_prox_log_prob": f"not needed: {_FULLY_ASYNC}, which takes each step's old log-probs "
    "from the weights the step started with",
    "async_training.use_trainer_do_validate": f"not needed: {_FULLY_ASYNC}, which validates on the rollout service "
    "every trainer.test_freq steps",
    "async_training.checkpoint_engine": f"not supported: {_FULLY_ASYNC}, whose weights reach the replicas through "
    "actor_rollout_ref.rollout.weight_sync",
    "async_training.compute_advantage_in_rollout": f"not supported: {_FULLY_ASYNC}, which computes advantages in "
    "the training step",
    "rollout.total_rollout_steps": f"not supported as a count of samples: {_FULLY_ASYNC}; set "
    "trainer.total_training_steps (steps of data.train_batch_size prompts)",
    "filter": "not supported: verl's fully async sample filter; algorithm.filter_groups is DAPO's group filter",
    "super_sample": "not supported: verl's fully async super-sampling; every prompt is sampled rollout.n times",
    "actor_rollout_ref.checkpoint_engine": f"not supported: {_FULLY_ASYNC}, whose weights reach the replicas "
    "through actor_rollout_ref.rollout.weight_sync",
}
"""verl key (or section) -> why ppoflow has no such setting."""
