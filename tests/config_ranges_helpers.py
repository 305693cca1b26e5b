"""The range rules of tests/test_config_ranges.py: one :class:`Rule` per numeric config field (:data:`RANGES`),
and :data:`OPEN`, the numeric keys whose every finite value is valid, with why."""

from __future__ import annotations

from typing import NamedTuple

from ppoflow.configs.schema import SEED_MAX

SEED_TOO_LARGE = "less than or equal to 4294967295 (got 4294967296)"
RC = "algorithm.rollout_correction."
ASYNC_GPUS = (
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.num_replicas=2",
    "actor_rollout_ref.rollout.resources.num_gpus=1",
)


class Rule(NamedTuple):
    """``key``'s range: ``bad`` values with a fragment of their problem, ``good`` boundary values that load;
    ``given``: overrides both need (a rule of another key the values would break otherwise)."""

    key: str
    bad: list[tuple[object, str]]
    good: list[object]
    given: tuple[str, ...] = ()


RANGES = [
    # data
    Rule("data.train_batch_size", [(0, ">= 1")], [1], ("actor_rollout_ref.actor.ppo_mini_batch_size=1",)),
    Rule(
        "data.gen_batch_size",
        [(0, ">= 1")],
        [1],
        ("data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1"),
    ),
    Rule("data.val_batch_size", [(0, ">= 1")], [1]),
    # DAPO
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.len", [(-1, ">= 0")], [0]),
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", [(-0.5, ">= 0")], [0.0]),
    Rule("reward_model.reward_kwargs.max_resp_len", [(0, ">= 1")], [1]),
    Rule("data.max_prompt_length", [(0, ">= 1")], [1]),
    Rule("data.max_response_length", [(0, ">= 1")], [1]),
    Rule("data.seed", [(-1, ">= 0 (got -1)"), (SEED_MAX + 1, SEED_TOO_LARGE)], [0, SEED_MAX]),
    Rule("data.synthetic.digits", [(0, ">= 1"), (9, "less than or equal to 8 (got 9)")], [1, 8]),
    Rule("data.synthetic.train_rows", [(0, ">= 1")], [1]),
    Rule("data.synthetic.val_rows", [(0, ">= 1")], [1]),
    Rule("data.synthetic.seed", [(-1, ">= 0 (got -1)"), (SEED_MAX + 1, SEED_TOO_LARGE)], [0, SEED_MAX]),
    Rule("data.synthetic.copy_share", [(-0.1, ">= 0 (got -0.1)"), (1.0, "less than 1 (got 1.0)")], [0.0, 0.99]),
    # the tiny model recipe
    Rule("actor_rollout_ref.model.build.hidden_size", [(7, "greater than or equal to 8 (got 7)")], [8]),
    Rule("actor_rollout_ref.model.build.intermediate_size", [(7, "greater than or equal to 8 (got 7)")], [8]),
    Rule("actor_rollout_ref.model.build.num_hidden_layers", [(0, ">= 1")], [1]),
    Rule(
        "actor_rollout_ref.model.build.num_attention_heads",
        [
            (0, ">= 1"),
            (3, "must divide hidden_size=128 (got 3)"),
            (128, "gives an odd head size hidden_size / num_attention_heads = 1; rotary embeddings need an even one"),
        ],
        [1, 64],
    ),
    Rule("actor_rollout_ref.model.build.max_position_embeddings", [(7, "greater than or equal to 8 (got 7)")], [8]),
    Rule("actor_rollout_ref.model.build.seed", [(-1, ">= 0 (got -1)"), (SEED_MAX + 1, SEED_TOO_LARGE)], [0, SEED_MAX]),
    # what a role's Ray actor reserves (the actor's; ref, rollout and critic share the section)
    Rule(
        "actor_rollout_ref.actor.resources.num_cpus",
        [(-1, ">= 0 (got -1)"), (0.00005, "must be 0 or at least 0.0001 (Ray's resource precision) (got 5e-05)")],
        [0, 0.0001],
    ),
    Rule(
        "actor_rollout_ref.actor.resources.num_gpus",
        [(-1, ">= 0 (got -1)"), (0.00005, "must be 0 or at least 0.0001 (Ray's resource precision)")],
        [0, 0.0001],
        ("trainer.n_gpus_per_node=1",),
    ),
    Rule("actor_rollout_ref.actor.resources.num_threads", [(0, ">= 1")], [1]),
    Rule(
        "actor_rollout_ref.actor.resources.custom",
        [
            ("{node: -1}", "each amount must be >= 0 (got {'node': -1})"),
            ("{node: 0.00005}", "each amount must be 0 or at least 0.0001 (Ray's resource precision)"),
        ],
        ["{node: 0}", "{node: 0.0001}"],
    ),
    # the optimizer (the critic's; the actor's shares the section)
    Rule("critic.optim.lr", [(0.0, "greater than 0 (got 0.0)"), (-1e-3, "greater than 0")], [1e-12]),
    Rule(
        "critic.optim.betas",
        [("[1.0,0.9]", "less than 1 (got 1.0)"), ("[0.9,-0.1]", ">= 0 (got -0.1)"), ("[0.9]", "at least 2 items")],
        ["[0.0,0.999999]"],
    ),
    Rule("critic.optim.weight_decay", [(-0.01, ">= 0 (got -0.01)")], [0.0]),
    Rule("critic.optim.lr_warmup_steps", [(-1, ">= 0 (got -1)")], [0]),
    # the update, shared by the actor and the critic (whose mini-batch and epochs default to the actor's)
    Rule("critic.ppo_mini_batch_size", [(0, ">= 1")], [1], ("algorithm.adv_estimator=gae",)),
    Rule("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", [(0, ">= 1")], [1]),
    Rule("critic.ppo_epochs", [(0, ">= 1")], [1], ("algorithm.adv_estimator=gae",)),
    Rule("actor_rollout_ref.actor.grad_clip", [(0.0, "greater than 0 (got 0.0)")], [1e-6]),
    Rule(
        "actor_rollout_ref.actor.clip_ratio_low",
        [(0.0, "greater than 0 (got 0.0)")],
        [0.001, 10.0],
    ),
    Rule("actor_rollout_ref.actor.clip_ratio_high", [(0.0, "greater than 0 (got 0.0)")], [0.001, 10.0]),
    Rule("actor_rollout_ref.actor.clip_ratio_c", [(1.0, "greater than 1 (got 1.0)")], [1.001]),
    Rule("actor_rollout_ref.actor.tau_pos", [(0.0, "greater than 0 (got 0.0)")], [1e-6]),
    Rule("actor_rollout_ref.actor.tau_neg", [(0.0, "greater than 0 (got 0.0)")], [1e-6]),
    Rule(
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
        [(0.0, "greater than 0 (got 0.0)"), (1.01, "less than or equal to 1")],
        [1e-6, 1.0],
    ),
    Rule(
        "actor_rollout_ref.actor.policy_loss.clip_cov_ub", [(1.0, "must be above clip_cov_lb=1.0 (got 1.0)")], [1.001]
    ),
    Rule(
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
        [(0.0, "greater than 0 (got 0.0)"), (1.01, "less than or equal to 1")],
        [1e-6, 1.0],
    ),
    Rule("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", [(-0.01, ">= 0 (got -0.01)")], [0.0]),
    Rule("actor_rollout_ref.actor.entropy_coeff", [(-0.01, ">= 0 (got -0.01)")], [0.0]),
    Rule("actor_rollout_ref.actor.kl_loss_coef", [(-0.01, ">= 0 (got -0.01)")], [0.0]),
    Rule("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", [(0, ">= 1")], [1]),
    Rule("critic.forward_micro_batch_size_per_gpu", [(0, ">= 1")], [1]),
    Rule("critic.cliprange_value", [(0.0, "greater than 0 (got 0.0)")], [1e-6]),
    # sampling; temperature 0 = greedy, top_k -1 or 0 = off
    Rule("actor_rollout_ref.rollout.n", [(0, ">= 1")], [1], ("algorithm.adv_estimator=reinforce_plus_plus",)),
    Rule("actor_rollout_ref.rollout.temperature", [(-0.1, ">= 0 (got -0.1)")], [0.0]),
    Rule(
        "actor_rollout_ref.rollout.top_p",
        [(0.0, "greater than 0 (got 0.0)"), (1.01, "less than or equal to 1")],
        [0.001, 1.0],
    ),
    Rule("actor_rollout_ref.rollout.top_k", [(-2, "greater than or equal to -1 (got -2)")], [-1, 0, 1]),
    Rule("actor_rollout_ref.rollout.seed", [(-1, ">= 0 (got -1)"), (SEED_MAX + 1, SEED_TOO_LARGE)], [0, SEED_MAX]),
    Rule("actor_rollout_ref.rollout.val_kwargs.n", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.val_kwargs.temperature", [(-0.1, ">= 0 (got -0.1)")], [0.0]),
    Rule(
        "actor_rollout_ref.rollout.val_kwargs.top_p",
        [(0.0, "greater than 0"), (1.01, "less than or equal to 1")],
        [0.001, 1.0],
    ),
    Rule("actor_rollout_ref.rollout.val_kwargs.top_k", [(-2, "greater than or equal to -1 (got -2)")], [-1, 0, 1]),
    # the rollout's engines
    Rule("actor_rollout_ref.rollout.num_replicas", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.max_num_seqs", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", [(0, ">= 1")], [1]),
    Rule(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        [(0.0, "greater than 0 (got 0.0)"), (1.01, "less than or equal to 1 (got 1.01)")],
        [0.001, 1.0],
    ),
    Rule("actor_rollout_ref.rollout.tensor_model_parallel_size", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.weight_sync.bucket_mb", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.agent.num_workers", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.multi_turn.max_tool_response_length", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.multi_turn.tool_processes", [(0, ">= 1")], [1]),
    # reward and algorithm
    Rule("custom_reward_function.timeout_s", [(0.0, "greater than 0 (got 0.0)")], [0.001]),
    Rule("reward_model.num_workers", [(0, ">= 1")], [1]),
    Rule("algorithm.gamma", [(-0.1, ">= 0 (got -0.1)"), (1.01, "less than or equal to 1 (got 1.01)")], [0.0, 1.0]),
    Rule("algorithm.lam", [(-0.1, ">= 0 (got -0.1)"), (1.01, "less than or equal to 1 (got 1.01)")], [0.0, 1.0]),
    Rule("algorithm.kl_ctrl.kl_coef", [(-0.1, ">= 0 (got -0.1)")], [0.0]),
    Rule("algorithm.kl_ctrl.horizon", [(0, "greater than 0 (got 0)")], [1]),
    Rule("algorithm.kl_ctrl.target_kl", [(0.0, "greater than 0 (got 0.0)")], [1e-6]),
    # the correction thresholds are checked by the run's own parser when the correction they bound is on
    Rule(
        f"{RC}rollout_is_threshold",
        [
            (0.0, "Invalid threshold 0.0: the upper bound must be > 0."),
            ("'0_2'", "Invalid threshold '0_2': the lower bound must be > 0."),
        ],
        [1e-6, "'0.5_2.0'"],
        (f"{RC}rollout_is=token",),
    ),
    Rule(
        f"{RC}rollout_rs_threshold",
        [
            (-1.0, "Invalid threshold -1.0: the upper bound must be > 0."),
            ("'2_1'", "Invalid threshold '2_1': the lower bound exceeds the upper bound."),
        ],
        [1.0, "'1_1'"],
        (f"{RC}rollout_rs=token_k1",),
    ),
    # trainer
    Rule("trainer.nnodes", [(0, ">= 1")], [1]),
    Rule("trainer.n_gpus_per_node", [(-1, ">= 0 (got -1)")], [0]),
    Rule("trainer.n_cpu_ranks_per_node", [(0, ">= 1")], [1]),
    Rule("trainer.total_epochs", [(0, ">= 1")], [1]),
    Rule("trainer.total_training_steps", [(0, ">= 1")], [1]),
    Rule("trainer.test_freq", [(-2, "greater than or equal to -1 (got -2)")], [-1, 0, 1]),
    Rule("trainer.save_freq", [(-2, "greater than or equal to -1 (got -2)")], [-1, 0, 1]),
    Rule("trainer.run_dir_wait_s", [(0.0, "greater than 0 (got 0.0)")], [0.001]),
    Rule("trainer.log_val_generations", [(-1, "greater than or equal to 0 (got -1)")], [0, 3]),
    Rule("trainer.v1.colocate_async.num_warmup_batches", [(-1, ">= 0 (got -1)")], [0]),
    Rule("trainer.v1.separate_async.num_warmup_batches", [(-1, ">= 0 (got -1)")], [0]),
    Rule("trainer.v1.separate_async.parameter_sync_step", [(0, ">= 1")], [1]),
    Rule("trainer.v1.sampler.max_off_policy_threshold", [(0, ">= 1")], [1]),
    # pools, Ray, caches
    Rule("rollout.nnodes", [(0, ">= 1")], [1]),
    Rule(
        "rollout.n_gpus_per_node",
        [
            (-1, ">= 0 (got -1)"),
            (1, "num_replicas=2 x actor_rollout_ref.rollout.resources.num_gpus=1 = 2 GPUs exceeds the rollout pool"),
        ],
        [2],
        ASYNC_GPUS,
    ),
    # LoRA, and the token budgets of dynamic batch sizes (their rule against the sequence length: test_packing)
    Rule("actor_rollout_ref.model.lora_rank", [(-1, ">= 0 (got -1)")], [0, 1]),
    Rule("actor_rollout_ref.model.lora_alpha", [(0, "greater than 0 (got 0)")], [1]),
    Rule(
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        [(0, ">= 1")],
        [1],
        (
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1",
        ),
    ),
    Rule("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", [(0, ">= 1")], [1]),
    Rule("critic.forward_max_token_len_per_gpu", [(0, ">= 1")], [1]),
    Rule("ray.worker_niceness", [(-1, ">= 0 (got -1)"), (20, "less than or equal to 19 (got 20)")], [0, 19]),
    Rule("ray.num_cpus", [(0, ">= 1"), (1.5, "Input should be a valid integer (got 1.5)")], [1]),
    Rule("ray.worker_allocator", [("tcmalloc", "Input should be 'jemalloc' or 'system' (got 'tcmalloc')")], ["system"]),
    Rule("skip.rollout.steps", [("[1,0]", ">= 1 (got 0)")], ["[1]"], ("skip.rollout.enable=true",)),
    # the profiler
    Rule(
        "global_profiler.steps",
        [("[1,0]", ">= 1 (got 0)")],
        ["[1]"],
        ("global_profiler.tool=torch", "actor_rollout_ref.actor.profiler.enable=true"),
    ),
    Rule("actor_rollout_ref.actor.profiler.ranks", [("[-1]", ">= 0 (got -1)")], ["[0]"]),
    Rule("global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries", [(0, ">= 1")], [1]),
    # the gateway and the openai_agent loop
    Rule("actor_rollout_ref.rollout.agent.gateway.port", [(-1, ">= 0"), (65536, "less than or equal to 65535")], [0]),
    Rule("actor_rollout_ref.rollout.agent.agent_function.max_concurrency", [(0, ">= 1")], [1]),
    Rule("actor_rollout_ref.rollout.agent.agent_function.timeout_s", [(0, "greater than 0")], [0.001]),
    # reward models, remote reward services, judges
    Rule("reward_model.micro_batch_size_per_gpu", [(0, ">= 1")], [1]),
    Rule("reward_model.max_length", [(0, ">= 1")], [1]),
    Rule("reward_model.forward_max_token_len_per_gpu", [(0, ">= 1")], [1]),
    Rule("reward_model.remote.batch_size", [(0, ">= 1")], [1]),
    Rule("reward_model.remote.max_concurrency", [(0, ">= 1")], [1]),
    Rule("reward_model.remote.timeout_s", [(0, "greater than 0")], [0.001]),
    Rule("reward_model.remote.max_retries", [(-1, ">= 0")], [0]),
    Rule("reward_model.remote.backoff_s", [(-0.1, ">= 0")], [0.0]),
    Rule("reward_model.judge.max_tokens", [(0, ">= 1")], [1]),
    Rule("reward_model.judge.temperature", [(-0.1, ">= 0")], [0.0]),
    Rule("reward_model.judge.timeout_s", [(0, "greater than 0")], [0.001]),
    Rule("reward_model.judge.num_replicas", [(0, ">= 1")], [1]),
    Rule("skip.rollout.timeout_s", [(0.0, "greater than 0 (got 0.0)")], [0.001]),
    Rule("skip.rollout.retries", [(-1, ">= 0 (got -1)")], [0]),
]

OPEN = {
    "custom_reward_function.timeout_score": "a score in the reward's own units: any finite number "
    "(a penalty may be negative)",
    "custom_reward_function.error_score": "a score in the reward's own units, as timeout_score",
    "algorithm.filter_groups.max_num_gen_batches": "verl's: any int, <= 0 meaning no limit",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb": "a bound on a covariance term, any sign "
    "(clip_cov_ub, above it, has the rule)",
    "reward_model.remote.error_score": "a score in the reward's own units, as timeout_score",
    "reward_model.judge.error_score": "a score in the judge's own units, as timeout_score",
}
"""Numeric keys whose every finite value is valid, and why (a non-finite float is refused for every key)."""
