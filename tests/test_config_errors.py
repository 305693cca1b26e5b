"""Refused configs: unknown keys, wrong types, out-of-range and non-finite values, malformed override words;
every problem of a load (values and rules) comes in one round, each naming its key."""

from __future__ import annotations

import pytest
import torch

from ppoflow.configs import ConfigError, load_config
from tests.config_helpers import only_problem, problems_of

# ------------------------------------------------------------------------------------ errors


def test_unknown_key_suggests_the_closest_known_key():
    assert only_problem(["actor_rollout_ref.actor.lr=0.1"]) == (
        "actor_rollout_ref.actor.lr",
        "unknown key; did you mean 'actor_rollout_ref.actor.optim.lr'?",
    )
    assert only_problem(["actor_rollout_ref.rollout.temprature=0.5"]) == (
        "actor_rollout_ref.rollout.temprature",
        "unknown key; did you mean 'actor_rollout_ref.rollout.temperature'?",
    )
    assert only_problem(["critic.optim.learning_rate=1"])[0] == "critic.optim.learning_rate"
    assert only_problem(["skip.rollout.stpes=[1]"]) == (
        "skip.rollout.stpes",
        "unknown key; did you mean 'skip.rollout.steps'?",
    )


def test_unknown_skip_stage_suggests_a_stage():
    assert only_problem(["skip.rolout.enable=true"]) == ("skip.rolout", "unknown cache; did you mean 'skip.rollout'?")
    key, message = only_problem(["skip.zzz.enable=true"])
    assert key == "skip.zzz"
    assert message == (
        "unknown cache; known: rollout, reward_model, reward, old_log_prob, ref, values, advantage, async_rollout"
    )


@pytest.mark.parametrize(
    "override, key, got",
    [
        ("data.train_batch_size=true", "data.train_batch_size", "True"),
        ("data.gen_batch_size=true", "data.gen_batch_size", "True"),
        ("trainer.total_epochs=2.5", "trainer.total_epochs", "2.5"),
        ("actor_rollout_ref.rollout.temperature=hot", "actor_rollout_ref.rollout.temperature", "'hot'"),
        ("actor_rollout_ref.rollout.temperature=true", "actor_rollout_ref.rollout.temperature", "True"),
        ("skip.rollout.steps=[1,x]", "skip.rollout.steps.1", "'x'"),
        ("skip.rollout.steps=[1,true]", "skip.rollout.steps.1", "True"),
        ("skip.rollout.enable=1", "skip.rollout.enable", "1"),
        ("data.shuffle=maybe", "data.shuffle", "'maybe'"),
        ("data.shuffle='true'", "data.shuffle", "'true'"),
    ],
)
def test_wrong_types_name_the_key_and_the_value(override, key, got):
    problem_key, message = only_problem([override])
    assert problem_key == key
    assert message.endswith(f"(got {got})")
    assert message.startswith("Input should be a valid")


def test_union_type_error_names_the_key_not_the_union_member():
    problems = problems_of("grpo_tiny", ["data.val_files=5"])
    assert {key for key, _ in problems} == {"data.val_files"}
    assert all(message.endswith("(got 5)") for _, message in problems)


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("data.train_batch_size=0", "data.train_batch_size", "Input should be greater than or equal to 1 (got 0)"),
        (
            "actor_rollout_ref.rollout.top_p=1.5",
            "actor_rollout_ref.rollout.top_p",
            "Input should be less than or equal to 1 (got 1.5)",
        ),
        (
            "actor_rollout_ref.rollout.top_p=0",
            "actor_rollout_ref.rollout.top_p",
            "Input should be greater than 0 (got 0)",
        ),
        (
            "actor_rollout_ref.actor.clip_ratio_c=1",
            "actor_rollout_ref.actor.clip_ratio_c",
            "Input should be greater than 1 (got 1)",
        ),
        ("algorithm.gamma=-0.1", "algorithm.gamma", "Input should be greater than or equal to 0 (got -0.1)"),
        (
            "actor_rollout_ref.actor.optim.betas=[0.9]",
            "actor_rollout_ref.actor.optim.betas",
            "List should have at least 2 items after validation, not 1 (got [0.9])",
        ),
    ],
)
def test_out_of_range_values(override, key, message):
    assert only_problem([override]) == (key, message)


@pytest.mark.parametrize(
    "override, key, message",
    [
        # YAML's .inf/.nan are floats that pass every range check unless non-finite floats are refused
        (
            "actor_rollout_ref.actor.optim.lr=.inf",
            "actor_rollout_ref.actor.optim.lr",
            "Input should be a finite number (got inf)",
        ),
        (
            "actor_rollout_ref.actor.optim.lr=inf",
            "actor_rollout_ref.actor.optim.lr",
            "Input should be a valid number (got 'inf')",
        ),
        (
            "actor_rollout_ref.actor.optim.betas=[.nan,0.99]",
            "actor_rollout_ref.actor.optim.betas.0",
            "Input should be a finite number (got nan)",
        ),
        ("critic.optim.weight_decay=.nan", "critic.optim.weight_decay", "Input should be a finite number (got nan)"),
        ("algorithm.kl_ctrl.kl_coef=-.inf", "algorithm.kl_ctrl.kl_coef", "Input should be a finite number (got -inf)"),
        (
            "actor_rollout_ref.model.build.num_attention_heads=3",
            "actor_rollout_ref.model.build.num_attention_heads",
            "must divide hidden_size=128 (got 3)",
        ),
    ],
)
def test_non_finite_and_unbuildable_values(override, key, message):
    assert only_problem([override]) == (key, message)


def test_adam_betas_are_each_in_zero_one():
    assert problems_of("grpo_tiny", ["actor_rollout_ref.actor.optim.betas=[1.5,2.0]"]) == [
        ("actor_rollout_ref.actor.optim.betas.0", "Input should be less than 1 (got 1.5)"),
        ("actor_rollout_ref.actor.optim.betas.1", "Input should be less than 1 (got 2.0)"),
    ]
    assert only_problem(["critic.optim.betas=[-0.1,0.9]"]) == (
        "critic.optim.betas.0",
        "Input should be greater than or equal to 0 (got -0.1)",
    )
    assert load_config(
        "grpo_tiny", ["actor_rollout_ref.actor.optim.betas=[0.0,0.5]"]
    ).actor_rollout_ref.actor.optim.betas == [0.0, 0.5]


@pytest.mark.parametrize(
    "word, adamw_kwargs",
    [
        ("critic.optim.lr=-1e-3", {"lr": -1e-3}),
        ("critic.optim.betas=[1.0,0.999]", {"betas": (1.0, 0.999)}),
        ("critic.optim.betas=[0.9,-0.1]", {"betas": (0.9, -0.1)}),
        ("critic.optim.weight_decay=-0.01", {"weight_decay": -0.01}),
    ],
)
def test_the_schema_refuses_what_torch_adamw_refuses(word, adamw_kwargs):
    """The optimizer keys' ranges are the schema's, checked without torch: what AdamW, which the worker
    builds, would refuse is refused before anything starts."""
    assert only_problem(["algorithm.adv_estimator=gae", word])[0].startswith(word.partition("=")[0])
    with pytest.raises(ValueError):
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **adamw_kwargs)


def test_literal_violations_list_the_choices():
    assert only_problem(["algorithm.adv_estimator=ppo"]) == (
        "algorithm.adv_estimator",
        "Input should be 'gae', 'grpo', 'rloo', 'reinforce_plus_plus' or 'reinforce_plus_plus_baseline' (got 'ppo')",
    )
    assert only_problem(["skip.rollout.action=random"]) == (
        "skip.rollout.action",
        "Input should be 'cache' or 'repeat' (got 'random')",
    )
    assert only_problem(["data.truncation=middle"])[0] == "data.truncation"


def test_several_problems_are_reported_at_once():
    problems = problems_of(
        "grpo_tiny",
        [
            "data.train_batch_size=0",
            "actor_rollout_ref.rollout.top_p=1.5",
            "algorithm.adv_estimator=ppo",
            "actor_rollout_ref.actor.lr=1",
        ],
    )
    assert [key for key, _ in problems] == [
        "data.train_batch_size",
        "actor_rollout_ref.actor.lr",
        "actor_rollout_ref.rollout.top_p",
        "algorithm.adv_estimator",
    ]
    with pytest.raises(ConfigError, match=r"invalid configuration \(4 problems\)"):
        load_config(
            "grpo_tiny",
            [
                "data.train_batch_size=0",
                "actor_rollout_ref.rollout.top_p=1.5",
                "algorithm.adv_estimator=ppo",
                "actor_rollout_ref.actor.lr=1",
            ],
        )
    with pytest.raises(ConfigError, match=r"invalid configuration \(1 problem\):"):
        load_config("grpo_tiny", ["data.train_batch_size=0"])


def test_missing_required_keys():
    assert problems_of("ppo_trainer", []) == [
        ("data.train_files", "is required; set it with data.train_files=..."),
        ("actor_rollout_ref.model.path", "is required; set it with actor_rollout_ref.model.path=..."),
    ]
    assert problems_of("ppo_trainer", ["actor_rollout_ref.model.path=/m"]) == [
        ("data.train_files", "is required; set it with data.train_files=...")
    ]
    cfg = load_config("ppo_trainer", ["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet"])
    assert cfg.critic.model.path == "/m" and cfg.algorithm.adv_estimator == "gae" and cfg.use_critic


@pytest.mark.parametrize("word", ["data.train_batch_size", "=5", "actor_rollout_ref.rollout.n"])
def test_malformed_override_word(word):
    assert only_problem([word]) == (word, "an override must look like key=value (lists as key=[1,2,3])")


def test_unparsable_override_value_names_its_key_and_word():
    key, message = only_problem(["trainer.experiment_name=ok", "skip.rollout.steps=[1,"])
    assert key == "skip.rollout.steps" and "skip.rollout.steps=[1," in message


@pytest.mark.parametrize("word", ["yes", "no", "on", "OFF"])
def test_yaml_11_boolean_words_are_not_guessed(word):
    key, message = only_problem([f"data.shuffle={word}"])
    assert key == "data.shuffle" and f"(got '{word}')" in message


def test_unresolvable_interpolation():
    key, message = only_problem(["trainer.experiment_name=${nope}"])
    assert key == "trainer.experiment_name" and message.startswith("cannot resolve")


# ------------------------------------------------------------------ every problem in one round


@pytest.mark.reliability
def test_unknown_keys_bad_values_and_rule_problems_come_in_one_round():
    problems = problems_of(
        "grpo_tiny",
        [
            "actor_rollout_ref.actor.clip_ratio=0.2",  # unknown (verl's) key
            "actor_rollout_ref.rollout.top_p=1.5",  # bad value
            "trainer.logger=[console,swanlab]",  # bad logger
            "actor_rollout_ref.rollout.name=vllm",  # rollout.name problems
            "actor_rollout_ref.rollout.mode=async",
        ],
    )
    keys = [key for key, _ in problems]
    assert keys[:3] == ["actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.rollout.top_p", "trainer.logger"]
    assert (
        "actor_rollout_ref.rollout.mode",
        "async serves the hf engine only so far, not rollout.name=vllm",
    ) in problems
    assert "actor_rollout_ref.rollout.name" in keys or "actor_rollout_ref.rollout.resources.num_gpus" in keys  # vllm's


@pytest.mark.reliability
def test_rule_problems_about_a_refused_key_are_left_out():
    # with data.train_batch_size at its stand-in value the mini-batch rule would talk about a batch nobody asked for
    assert only_problem(["data.train_batch_size=0", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]) == (
        "data.train_batch_size",
        "Input should be greater than or equal to 1 (got 0)",
    )
    # a rule about another key is still reported, and so is one whose stand-in came from the defaults
    assert problems_of("grpo_tiny", ["data.train_batch_size=0", "actor_rollout_ref.rollout.n=1"]) == [
        ("data.train_batch_size", "Input should be greater than or equal to 1 (got 0)"),
        (
            "actor_rollout_ref.rollout.n",
            "algorithm.adv_estimator=grpo compares responses of one prompt and needs n >= 2, got 1",
        ),
    ]


@pytest.mark.reliability
def test_rules_run_when_the_preset_itself_holds_the_bad_value(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "data: {train_files: /t.parquet, train_batch_size: 0}\n"
        "actor_rollout_ref: {model: {path: /m}}\n"
        "algorithm: {adv_estimator: grpo}\n"
    )
    problems = problems_of(str(tmp_path / "run.yaml"), ["actor_rollout_ref.rollout.n=1", "skip.rolout.enable=true"])
    assert [key for key, _ in problems] == ["data.train_batch_size", "skip.rolout", "actor_rollout_ref.rollout.n"]


@pytest.mark.reliability
def test_disagreeing_trainer_modes_come_with_the_other_problems():
    assert [
        key
        for key, _ in problems_of(
            "grpo_tiny", ["trainer.mode=sync", "trainer.v1.trainer_mode=one_step_off", "data.train_batch_size=0"]
        )
    ] == ["trainer.v1.trainer_mode", "data.train_batch_size"]
