"""Every numeric config key has its valid range checked when the config loads, before Prefect or Ray start.

:data:`RANGES` holds one rule per numeric field of the schema (a section used in several places, such as
``resources`` or ``optim``, is tried at one of its keys): values just outside the range, each refused with a
problem naming the key and the value, and the boundary values just inside it, which load.
:func:`test_every_numeric_field_has_its_range_tried` keeps the table complete: a new int or float key must
get a rule here, or a place in :data:`OPEN` with the reason its values are all valid. The loader runs in
this process; two cases run the command line, which exits 2 before Ray is started.
"""

from __future__ import annotations

import typing
from typing import Literal, NamedTuple

import pytest
from pydantic import BaseModel

from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.schema import SEED_MAX, PPOConfig, SkipStageConfig

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
    Rule("skip.rollout.steps", [("[1,0]", ">= 1 (got 0)")], ["[1]"], ("skip.rollout.enable=true",)),
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
}
"""Numeric keys whose every finite value is valid, and why (a non-finite float is refused for every key)."""


def word(key: str, value) -> str:
    return f"{key}={value}"


def problems_of(words: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config("grpo_tiny", words)
    return caught.value.problems


def expand(message: str) -> str:
    """``>= 1`` is shorthand for pydantic's ``greater than or equal to 1``."""
    return message.replace(">= ", "greater than or equal to ") if message.startswith(">= ") else message


BAD = [
    pytest.param(rule.key, value, expand(fragment), rule.given, id=f"{rule.key}={value}")
    for rule in RANGES
    for value, fragment in rule.bad
]
GOOD = [pytest.param(rule.key, value, rule.given, id=f"{rule.key}={value}") for rule in RANGES for value in rule.good]


@pytest.mark.parametrize("key, value, fragment, given", BAD)
def test_a_value_outside_the_range_is_refused_naming_the_key(key, value, fragment, given):
    problems = problems_of([*given, word(key, value)])
    named = [message for problem_key, message in problems if problem_key == key or problem_key.startswith(f"{key}.")]
    assert any(fragment in message for message in named), problems  # the key, or its list item (betas.0)
    assert len(problems) == 1, problems  # nothing else is blamed for the value


@pytest.mark.parametrize("key, value, given", GOOD)
def test_the_boundary_values_load(key, value, given):
    cfg = load_config("grpo_tiny", [*given, word(key, value)])
    assert cfg is not None


def test_every_bad_value_is_reported_in_one_round():
    """The rules that need no other override, all broken at once: each is reported, none hides another."""
    alone = [(rule.key, value) for rule in RANGES if not rule.given for value, _ in rule.bad[:1]]
    problems = problems_of([word(key, value) for key, value in alone])
    reported = {key for key, _ in problems}
    missing = [key for key, _ in alone if not any(got == key or got.startswith(f"{key}.") for got in reported)]
    assert missing == [] and len(problems) == len(alone), problems


def _numeric(annotation) -> bool:
    """Whether a field holds numbers: int or float, alone or inside Optional, Union, list or dict."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) is Literal:
        return False
    return any(_numeric(argument) for argument in typing.get_args(annotation))


def _sections(annotation) -> list[type[BaseModel]]:
    return [
        argument
        for argument in (annotation, *typing.get_args(annotation))
        if isinstance(argument, type) and issubclass(argument, BaseModel)
    ]


def _owner(model: type[BaseModel], name: str) -> str:
    """``Class.field`` of the class that declares the field (a section reused in several places is one rule)."""
    declaring = next(cls for cls in model.__mro__ if name in vars(cls).get("__annotations__", {}))
    return f"{declaring.__name__}.{name}"


def _numeric_fields(model: type[BaseModel], prefix: str = "", found: dict | None = None) -> dict[str, str]:
    """Each numeric field of the schema, ``Class.field`` -> the first config key that reaches it."""
    found = {} if found is None else found
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if name == "skip" and model is PPOConfig:
            _numeric_fields(SkipStageConfig, "skip.rollout.", found)
        elif _sections(field.annotation):
            _numeric_fields(_sections(field.annotation)[0], f"{key}.", found)
        elif _numeric(field.annotation):
            found.setdefault(_owner(model, name), key)
    return found


def _field_of(key: str) -> str:
    """``Class.field`` that a dotted config key reaches."""
    model, parts = PPOConfig, key.split(".")
    if parts[0] == "skip":
        model, parts = SkipStageConfig, parts[2:]
    for name in parts[:-1]:
        model = _sections(model.model_fields[name].annotation)[0]
    return _owner(model, parts[-1])


def test_every_numeric_field_has_its_range_tried():
    fields = _numeric_fields(PPOConfig)
    assert len(fields) > 80  # the walk reached the whole schema
    tried = [_field_of(rule.key) for rule in RANGES] + [_field_of(key) for key in OPEN]
    assert len(tried) == len(set(tried)), "a field has two rules"
    untried = {field: key for field, key in fields.items() if field not in tried}
    assert untried == {}, "give these keys a rule in RANGES (or a reason in OPEN)"
    assert all(rule.bad and rule.good for rule in RANGES)


@pytest.mark.reliability
@pytest.mark.parametrize("key, value", [("actor_rollout_ref.rollout.top_p", 0.0), ("ray.num_cpus", 1.5)])
def test_the_command_line_refuses_it_before_ray_starts(capsys, monkeypatch, tmp_path, key, value):
    import ray

    from tests.preflight_helpers import assert_user_error, run_cli

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a config that does not load")

    monkeypatch.setattr(ray, "init", no_ray)
    code, stderr = run_cli(capsys, "train", word(key, value), f"trainer.default_local_dir={tmp_path}/run")
    assert_user_error(code, stderr, f"  {key}: ", f"(got {value})")
    assert not (tmp_path / "run").exists()


@pytest.mark.reliability
def test_ppoflow_config_lists_every_out_of_range_key(capsys):
    from tests.preflight_helpers import assert_user_error, run_cli

    code, stderr = run_cli(
        capsys, "config", "data.seed=-1", "actor_rollout_ref.actor.clip_ratio_low=0", "skip.rollout.steps=[0]"
    )
    assert_user_error(
        code,
        stderr,
        "(3 problems)",
        "  data.seed: Input should be greater than or equal to 0 (got -1)",
        "  actor_rollout_ref.actor.clip_ratio_low: Input should be greater than 0 (got 0)",
        "  skip.rollout.steps.0: Input should be greater than or equal to 1 (got 0)",
    )
