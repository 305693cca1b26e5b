"""configs/: YAML defaults and presets, key=value overrides, typed validation, cross-field rules."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pydantic
import pytest
import torch
from omegaconf import OmegaConf

from ppoflow.configs import CONFIG_DIR, ConfigError, load_config, preset_names, reference_table
from ppoflow.configs.schema import PATH_NAME_RULE, SyntheticDataConfig

DEMO_PATHS = ["data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet"]


def problems_of(config: str | None, overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config(config, overrides)
    assert len(caught.value.problems) >= 1
    # the message of the exception lists every problem as "key: message"
    for key, message in caught.value.problems:
        assert f"  {key}: {message}" in str(caught.value)
    return caught.value.problems


def only_problem(overrides: list[str], config: str | None = "grpo_tiny") -> tuple[str, str]:
    problems = problems_of(config, overrides)
    assert len(problems) == 1, problems
    return problems[0]


# ------------------------------------------------------------------------------------ loading


def test_demo_preset_loads_with_its_values():
    cfg = load_config("grpo_tiny")
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == 1.0e-3
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.99]
    assert cfg.data.max_prompt_length == 8 and cfg.data.max_response_length == 3
    assert cfg.data.synthetic.digits == 2 and cfg.data.synthetic.train_rows == 3200
    assert cfg.actor_rollout_ref.model.build.hidden_size == 128
    assert cfg.trainer.total_training_steps == 200 and cfg.trainer.test_freq == 20
    # keys the preset does not set come from ppo_trainer.yaml
    assert cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert cfg.critic.optim.lr == 1.0e-5
    # no config name = the demo
    assert load_config(None) == cfg
    assert preset_names() == ["grpo_tiny", "ppo_trainer", "vault_tool"]


def test_yaml_file_path_is_merged_over_the_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "data:\n  train_files: /d/t.jsonl\n  train_batch_size: 8\n"
        "actor_rollout_ref:\n  model:\n    path: /models/m\n  actor:\n    ppo_mini_batch_size: 4\n"
    )
    cfg = load_config(str(path), ["actor_rollout_ref.rollout.temperature=0.7"])
    assert cfg.data.train_files == "/d/t.jsonl"
    assert cfg.data.train_batch_size == 8
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4
    assert cfg.actor_rollout_ref.rollout.temperature == 0.7
    assert cfg.algorithm.adv_estimator == "gae"  # ppo_trainer default
    assert cfg.critic.model.path == "/models/m"  # interpolation of actor_rollout_ref.model.path
    assert cfg.critic.ppo_mini_batch_size == 4  # interpolation of the actor's mini-batch


def test_missing_yaml_file_and_unknown_preset(tmp_path):
    key, message = problems_of(str(tmp_path / "nope.yaml"), [])[0]
    assert key == "--config" and "no such file" in message and "nope.yaml" in message
    key, message = problems_of("grpo_tinyy", [])[0]
    assert key == "--config"
    assert "unknown preset 'grpo_tinyy'" in message
    assert "grpo_tiny, ppo_trainer" in message


def test_unreadable_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("data: [unclosed\n")
    key, message = problems_of(str(path), [])[0]
    assert key == str(path) and message.startswith("unreadable YAML")


@pytest.mark.parametrize("text, kind", [("- data\n- trainer\n", "list"), ("just words\n", "str")])
def test_yaml_that_is_not_a_mapping_names_the_file(tmp_path, text, kind):
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    key, message = only_problem([], config=str(path))
    assert key == str(path)
    assert message == f"a config file holds a mapping of sections (data:, trainer:, ...) at its top level, not a {kind}"


# --------------------------------------------------------------------- build and synthetic recipes


def test_overriding_a_path_drops_the_presets_recipe_for_it():
    cfg = load_config("grpo_tiny", ["actor_rollout_ref.model.path=/models/mine", "data.train_files=/d/train.parquet"])
    assert cfg.actor_rollout_ref.model.build is None  # a typo in /models/mine must not train a random model
    assert cfg.data.synthetic is None
    cfg = load_config("grpo_tiny", ["data.val_files=/d/val.parquet"])
    assert cfg.data.synthetic is None and cfg.actor_rollout_ref.model.build is not None


def test_overriding_a_recipe_key_asks_for_building_explicitly():
    cfg = load_config(
        "grpo_tiny",
        [
            "actor_rollout_ref.model.path=/models/new",
            "actor_rollout_ref.model.build.seed=1",
            "data.train_files=/d/t.parquet",
            "data.synthetic.train_rows=64",
        ],
    )
    assert cfg.actor_rollout_ref.model.build.seed == 1 and cfg.actor_rollout_ref.model.build.hidden_size == 128
    assert cfg.data.synthetic.train_rows == 64 and cfg.data.synthetic.digits == 2
    # the whole section counts too; a path overridden to null names nothing to build or generate
    cfg = load_config("grpo_tiny", ["data.train_files=/d/t.parquet", "data.synthetic={task: copy}"])
    assert cfg.data.synthetic.task == "copy"
    cfg = load_config("grpo_tiny", ["data.val_files=null", "trainer.test_freq=-1"])
    assert cfg.data.synthetic is not None
    # without an override the preset's recipes apply to the preset's paths
    demo = load_config("grpo_tiny")
    assert demo.actor_rollout_ref.model.build is not None and demo.data.synthetic is not None


def test_a_critic_path_override_drops_the_critic_recipe_only(tmp_path):
    path = tmp_path / "critic.yaml"
    path.write_text("critic:\n  model:\n    build: {seed: 3}\n")
    assert load_config(str(path), DEMO_PATHS + ["actor_rollout_ref.model.path=/m"]).critic.model.build.seed == 3
    cfg = load_config(str(path), DEMO_PATHS + ["actor_rollout_ref.model.path=/m", "critic.model.path=/c"])
    assert cfg.critic.model.build is None and cfg.critic.model.path == "/c"


# ------------------------------------------------------------------------------ verl defaults

VERL_KEYS = (
    [
        f"data.{k}"
        for k in (
            "train_files",
            "val_files",
            "train_batch_size",
            "gen_batch_size",
            "max_prompt_length",
            "max_response_length",
            "seed",
            "shuffle",
        )
    ]
    + ["actor_rollout_ref.model.path"]
    + [
        f"actor_rollout_ref.actor.{k}"
        for k in (
            "ppo_mini_batch_size",
            "ppo_epochs",
            "clip_ratio_low",
            "clip_ratio_high",
            "clip_ratio_c",
            "loss_agg_mode",
            "entropy_coeff",
            "use_kl_loss",
            "kl_loss_coef",
            "kl_loss_type",
            "optim.lr",
            "grad_clip",
        )
    ]
    + [f"actor_rollout_ref.rollout.{k}" for k in ("name", "n", "temperature", "top_p", "top_k")]
    + [
        f"critic.{k}"
        for k in (
            "enable",
            "model.path",
            "ppo_mini_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_epochs",
            "cliprange_value",
            "loss_agg_mode",
            "grad_clip",
            "optim.lr",
        )
    ]
    + [
        f"algorithm.{k}"
        for k in (
            "adv_estimator",
            "gamma",
            "lam",
            "norm_adv_by_std_in_grpo",
            "use_kl_in_reward",
            "kl_penalty",
            "kl_ctrl.type",
            "kl_ctrl.kl_coef",
            "kl_ctrl.horizon",
            "kl_ctrl.target_kl",
        )
    ]
    + [
        f"trainer.{k}"
        for k in (
            "project_name",
            "experiment_name",
            "total_epochs",
            "total_training_steps",
            "test_freq",
            "default_local_dir",
            "logger",
        )
    ]
    + [f"skip.rollout.{k}" for k in ("enable", "dump_dir", "steps", "action")]
)


def test_defaults_hold_every_verl_key():
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)
    absent = []
    for key in VERL_KEYS:
        node = defaults
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError or isinstance(node, dict):
            absent.append(key)
    assert absent == []
    # 8 data + 1 model + 12 actor + 5 rollout + 9 critic + 10 algorithm + 7 trainer + 4 skip
    assert len(VERL_KEYS) == 56


def test_verl_default_values():
    cfg = load_config("grpo_tiny")
    skip = cfg.skip["rollout"]
    assert skip.enable is False
    assert skip.dump_dir == os.path.join(os.path.expanduser("~"), ".verl", "rollout_dump")
    assert skip.steps == []
    assert skip.action == "cache"
    assert list(cfg.skip) == ["rollout"]
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.2, 3.0)
    assert actor.loss_agg_mode == "token-mean" and actor.kl_loss_type == "low_var_kl"
    assert actor.use_kl_loss is False and actor.kl_loss_coef == 0.001
    assert cfg.algorithm.kl_penalty == "kl" and cfg.algorithm.kl_ctrl.type == "fixed"
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (1.0, 1.0)
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.actor_rollout_ref.rollout.top_k == -1
    assert cfg.trainer.logger == ["console"] and cfg.trainer.project_name == "ppoflow"


# --------------------------------------------------------------------------------- overrides


def test_interpolation_follows_overrides(tmp_path):
    cfg = load_config("grpo_tiny", ["trainer.experiment_name=foo"])
    assert cfg.trainer.default_local_dir == str(Path.cwd() / "checkpoints" / "ppoflow" / "foo")
    cfg = load_config("grpo_tiny", ["trainer.project_name=p", "trainer.experiment_name=e"])
    assert cfg.trainer.default_local_dir.endswith("/checkpoints/p/e")


def test_lists_on_the_command_line():
    cfg = load_config(
        "grpo_tiny",
        [
            "skip.rollout.steps=[1,2,3]",
            "trainer.logger=[console,tensorboard]",
            "actor_rollout_ref.actor.optim.betas=[0.5,0.75]",
            "skip.rollout.enable=true",
        ],
    )
    assert cfg.skip["rollout"].steps == [1, 2, 3]
    assert cfg.skip["rollout"].enable is True
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.5, 0.75]
    assert load_config("grpo_tiny", ["trainer.logger=[]"]).trainer.logger == []


def test_relative_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config(
        "grpo_tiny",
        [
            "skip.rollout.dump_dir=cache/dir",
            "actor_rollout_ref.model.path=~/m",
            "data.train_files=[a.parquet,s3://bucket/b.parquet]",
            "data.val_files=file://" + str(tmp_path / "v.parquet"),
        ],
    )
    root = str(tmp_path.resolve())
    assert cfg.skip["rollout"].dump_dir == f"{root}/cache/dir"
    assert cfg.actor_rollout_ref.model.path == f"{tmp_path}/home/m"
    assert cfg.critic.model.path == f"{tmp_path}/home/m"
    assert cfg.data.train_files == [f"{root}/a.parquet", "s3://bucket/b.parquet"]
    assert cfg.data.val_files == f"{root}/v.parquet"
    assert cfg.trainer.default_local_dir == f"{root}/checkpoints/ppoflow/grpo_tiny"
    assert cfg.skip["rollout"].dump_dir.startswith("/")


def test_use_critic_and_use_reference():
    demo = load_config("grpo_tiny")
    assert demo.use_critic is False and demo.use_reference is False
    gae = load_config("grpo_tiny", ["algorithm.adv_estimator=gae"])
    assert gae.use_critic is True
    forced = load_config("grpo_tiny", ["critic.enable=true"])
    assert forced.use_critic is True
    assert load_config("grpo_tiny", ["actor_rollout_ref.actor.use_kl_loss=true"]).use_reference is True
    assert load_config("grpo_tiny", ["algorithm.use_kl_in_reward=true"]).use_reference is True
    assert demo.gen_batch_size == 16


@pytest.mark.parametrize(
    "words",
    [
        ["actor_rollout_ref.actor.ppo_epochs=2"],
        ["actor_rollout_ref.actor.ppo_mini_batch_size=8"],
        ["algorithm.rollout_correction.bypass_mode=true"],
        ["algorithm.rollout_correction.rollout_is=token"],
        [
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ],
        ["algorithm.use_kl_in_reward=true"],
        ["skip.old_log_prob.enable=true", "skip.old_log_prob.steps=[1]"],
    ],
)
def test_old_log_probs_come_from_the_update_only_when_it_is_on_policy(words):
    assert load_config("grpo_tiny").old_log_probs_from_update is True  # one epoch, one mini-batch
    assert load_config("grpo_tiny", words).old_log_probs_from_update is False


def test_config_is_frozen():
    cfg = load_config("grpo_tiny")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.data.train_batch_size = 3


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
    assert message == "unknown cache; known: rollout, reward, old_log_prob, ref, values, advantage, async_rollout"


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


# ------------------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "data.train_batch_size * rollout.n = 128 trajectories is not divisible by "
            "ppo_mini_batch_size * rollout.n = 24",
        ),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "7 does not divide the mini-batch of 128 trajectories",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
            "critic.ppo_mini_batch_size",
            "128 trajectories per step are not divisible by critic mini-batch 24",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=48"],
            "critic.ppo_micro_batch_size_per_gpu",
            "48 does not divide the critic mini-batch of 128",
        ),
        (
            ["data.gen_batch_size=32"],
            "data.gen_batch_size",
            "32 != data.train_batch_size 16: dynamic sampling (generating more prompts than are trained on) is not "
            "supported; leave it null",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.enable=false"],
            "critic.enable",
            "algorithm.adv_estimator=gae needs a critic; set critic.enable=true or null",
        ),
        (
            ["actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.rollout.n",
            "algorithm.adv_estimator=grpo compares responses of one prompt and needs n >= 2, got 1",
        ),
        (
            ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.rollout.n",
            "algorithm.adv_estimator=rloo compares responses of one prompt and needs n >= 2, got 1",
        ),
        (
            ["algorithm.kl_penalty=k4"],
            "algorithm.kl_penalty",
            "Input should be 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3', 'kl+', 'k1+', 'abs+', 'mse+', 'k2+', "
            "'low_var_kl+' or 'k3+' (got 'k4')",
        ),
        (
            ["actor_rollout_ref.actor.kl_loss_type=full"],
            "actor_rollout_ref.actor.kl_loss_type",
            "Input should be 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3', 'kl+', 'k1+', 'abs+', 'mse+', 'k2+', "
            "'low_var_kl+' or 'k3+' (got 'full')",
        ),
        (["data.val_files=null"], "data.val_files", "trainer.test_freq=20 needs validation files"),
        (["skip.rollout.enable=true"], "skip.rollout.steps", "caching is enabled but no step is listed"),
        (
            ["skip.reward.enable=true", "skip.reward.steps=[]"],
            "skip.reward.steps",
            "caching is enabled but no step is listed",
        ),
        (["skip.ref.enable=true", "skip.ref.steps=[1]"], "skip.ref.enable", "this run has no ref stage to cache"),
        # data-parallel training: W = trainer.nnodes x (n_gpus_per_node, or n_cpu_ranks_per_node on CPUs) ranks per role
        (
            ["trainer.n_cpu_ranks_per_node=0"],
            "trainer.n_cpu_ranks_per_node",
            "Input should be greater than or equal to 1 (got 0)",
        ),
        (
            ["trainer.n_cpu_ranks_per_node=2", "actor_rollout_ref.hybrid_engine=true"],
            "actor_rollout_ref.hybrid_engine",
            "a colocated rollout needs one training rank, but the training roles run as 2 ranks (W = 2 from "
            "trainer.nnodes=1 x trainer.n_cpu_ranks_per_node=2); use hybrid_engine=false (a separate rollout) or null",
        ),
        (
            ["trainer.nnodes=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "mini-batches of 4 x rollout.n=8 = 32 trajectories cannot be split evenly over 3 training ranks "
            "(W = 3 from trainer.nnodes=3 x trainer.n_cpu_ranks_per_node=1)",
        ),
        (
            [
                "trainer.n_cpu_ranks_per_node=3",
                "algorithm.adv_estimator=gae",
                "actor_rollout_ref.rollout.n=1",
                "data.train_batch_size=12",
                "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                "critic.ppo_mini_batch_size=4",
            ],
            "critic.ppo_mini_batch_size",
            "mini-batches of 4 x rollout.n=1 = 4 trajectories cannot be split evenly over 3 "
            "training ranks (W = 3 from trainer.nnodes=1 x trainer.n_cpu_ranks_per_node=3)",
        ),
        (
            ["actor_rollout_ref.actor.fsdp_config.offload_policy=true"],
            "actor_rollout_ref.actor.fsdp_config.offload_policy",
            "offloading moves GPU memory to the CPU, but the training pool is on CPUs (trainer.n_gpus_per_node=0); set "
            "offload_policy=false",
        ),
        (
            ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.ref.fsdp_config.offload_policy=true"],
            "actor_rollout_ref.ref.fsdp_config.offload_policy",
            "offloading moves GPU memory to the CPU, but the training pool is on CPUs (trainer.n_gpus_per_node=0); set "
            "offload_policy=false",
        ),
        (
            ["actor_rollout_ref.actor.resources.custom={trainer_node: -1}"],
            "actor_rollout_ref.actor.resources.custom",
            "each amount must be >= 0 (got {'trainer_node': -1})",
        ),
        (["critic.strategy=fsdp"], "critic.strategy", "Input should be 'fsdp2' (got 'fsdp')"),
    ],
)
def test_cross_field_rules(overrides, key, message):
    assert only_problem(overrides) == (key, message)


def test_cross_field_rules_hold_when_the_values_fit():
    # 16 prompts x 8 = 128 trajectories; mini-batch 4 x 8 = 32 divides it; micro 16 divides 32
    cfg = load_config(
        "grpo_tiny",
        [
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "data.gen_batch_size=16",
            "algorithm.kl_penalty=low_var_kl+",
            "data.val_files=null",
            "trainer.test_freq=0",
            "skip.rollout.enable=true",
            "skip.rollout.steps=[1]",
        ],
    )
    assert cfg.gen_batch_size == 16 and cfg.data.val_files is None
    # the critic rules are not checked when no critic runs
    load_config("grpo_tiny", ["critic.ppo_mini_batch_size=3"])


def test_data_parallel_size_and_the_colocated_layout():
    demo = load_config("grpo_tiny")
    assert demo.data_parallel_size == 1 and demo.colocated is True
    assert demo.actor_rollout_ref.actor.strategy == "fsdp2" and demo.critic.fsdp_config.reshard_after_forward is True
    assert demo.actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype is None
    assert demo.actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype == "float32"
    assert demo.actor_rollout_ref.rollout.resources.custom == {}
    # on CPUs: nnodes x n_cpu_ranks_per_node; a sharded actor cannot generate, so null resolves to a separate rollout
    cpus = load_config("grpo_tiny", ["trainer.nnodes=2", "trainer.n_cpu_ranks_per_node=2"])
    assert cpus.data_parallel_size == 4 and cpus.colocated is False
    # on GPUs n_cpu_ranks_per_node is unused: nnodes x n_gpus_per_node
    gpus = load_config(
        "grpo_tiny",
        [
            "trainer.n_gpus_per_node=2",
            "trainer.n_cpu_ranks_per_node=4",
            "actor_rollout_ref.actor.resources.num_gpus=1",
            "actor_rollout_ref.rollout.resources.num_gpus=1",
            "rollout.n_gpus_per_node=1",
        ],
    )
    assert gpus.data_parallel_size == 2 and gpus.colocated is False
    assert (
        load_config("grpo_tiny", ["trainer.n_cpu_ranks_per_node=2", "actor_rollout_ref.hybrid_engine=false"]).colocated
        is False
    )
    # offloading is allowed from GPUs; custom resources take YAML ints and floats
    offload = load_config(
        "grpo_tiny",
        [
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.resources.num_gpus=1",
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
            "actor_rollout_ref.actor.resources.custom={trainer_node: 1, other: 0.5}",
        ],
    )
    assert offload.actor_rollout_ref.actor.resources.custom == {"trainer_node": 1.0, "other": 0.5}


@pytest.mark.parametrize("preset", ["grpo_tiny", "vault_tool", "ppo_trainer"])
def test_shipped_presets_are_one_rank_per_role(preset):
    from ppoflow.configs.rules_resources import data_parallel_errors

    cfg = load_config(
        preset, [] if preset != "ppo_trainer" else ["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet"]
    )
    assert cfg.data_parallel_size == 1 and data_parallel_errors(cfg) == []


def test_several_cross_field_problems_at_once():
    problems = problems_of("grpo_tiny", ["actor_rollout_ref.rollout.n=1", "data.gen_batch_size=32"])
    assert [key for key, _ in problems] == ["data.gen_batch_size", "actor_rollout_ref.rollout.n"]


def test_unknown_loggers_are_refused_by_the_schema():
    assert only_problem(["trainer.logger=[console,wandb,mlflow]"]) == (
        "trainer.logger",
        "unknown logger 'wandb', 'mlflow'; choose from console, tensorboard (got ['console', 'wandb', 'mlflow'])",
    )
    cfg = load_config("grpo_tiny", ["trainer.logger=[console,tensorboard]"])
    assert cfg.trainer.logger == ["console", "tensorboard"]


# ------------------------------------------------------------------ every problem in one round


@pytest.mark.reliability
def test_unknown_keys_bad_values_and_rule_problems_come_in_one_round():
    problems = problems_of(
        "grpo_tiny",
        [
            "actor_rollout_ref.actor.clip_ratio=0.2",  # unknown (verl's) key
            "actor_rollout_ref.rollout.top_p=1.5",  # bad value
            "trainer.logger=[console,wandb]",  # bad logger
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


# ------------------------------------------------------------------ names that become paths


SAFE_NAMES = ["grpo_tiny", "Art Test_1", "qwen2.5-7b+lr=1e-6@a100,b", "_x", "7", "a" * 100]
UNSAFE_NAMES = [
    "../../../somewhere",
    "a/b",
    "a\\b",
    "..",
    ".",
    ".hidden",
    "-rf",
    "",
    " lead",
    "trail ",
    "a" * 101,
    "tab\there",
    "nul\x00byte",
    "new\nline",
    "é",
]


@pytest.mark.parametrize("name", SAFE_NAMES)
def test_safe_names_become_one_directory(name):
    cfg = load_config(
        "grpo_tiny", [f"trainer.project_name={json.dumps(name)}", f"trainer.experiment_name={json.dumps(name)}"]
    )
    assert cfg.trainer.experiment_name == name
    assert cfg.trainer.default_local_dir == str(Path(f"checkpoints/{name}/{name}").absolute())


@pytest.mark.reliability
@pytest.mark.parametrize("key", ["trainer.experiment_name", "trainer.project_name"])
@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_names_that_would_leave_their_directory_are_refused(key, name):
    problems = problems_of("grpo_tiny", [f"{key}={json.dumps(name)}"])  # YAML reads JSON's escapes (\t, \u0000)
    assert (key, f"must be one directory name: {PATH_NAME_RULE} (got {name!r})") in problems
    # the run directory is built from the name: a NUL byte makes it no path either
    assert [other for other, _ in problems if other != key] == (["trainer.default_local_dir"] if "\0" in name else [])


@pytest.mark.reliability
def test_a_nul_byte_in_a_path_is_a_problem_not_a_crash():
    assert only_problem(['data.train_files="/data/a\\u0000b.parquet"']) == (
        "data.train_files",
        "is not a path: embedded null byte (got '/data/a\\x00b.parquet')",
    )


@pytest.mark.reliability
def test_the_command_line_refuses_a_name_outside_the_checkpoint_root(capsys, tmp_path):
    from tests.test_preflight import assert_user_error, run_cli

    code, stderr = run_cli(capsys, "config", "trainer.experiment_name=../../../somewhere")
    assert_user_error(code, stderr, "trainer.experiment_name: must be one directory name", "'../../../somewhere'")


@pytest.mark.reliability
def test_the_ui_forms_experiment_name_is_checked_before_the_run_starts():
    from ppoflow.flows.train import ppo_train

    with pytest.raises(ConfigError) as caught:  # the flow's body: what a run from the deployment's form calls
        ppo_train.fn(config="grpo_tiny", experiment_name="../../../somewhere")
    assert caught.value.problems == [
        ("trainer.experiment_name", f"must be one directory name: {PATH_NAME_RULE} (got '../../../somewhere')")
    ]


def test_the_ui_form_refuses_a_name_that_is_not_one_directory():
    """The deployment's form carries the rule itself (Prefect validates a run's parameters against it)."""
    from prefect.utilities.callables import parameter_schema

    from ppoflow.configs.schema import PATH_NAME_PATTERN
    from ppoflow.flows.train import ppo_train

    field = parameter_schema(ppo_train.fn).model_dump()["properties"]["experiment_name"]
    assert PATH_NAME_PATTERN in json.dumps(field)
    assert re.fullmatch(PATH_NAME_PATTERN, "run 7") and not re.fullmatch(PATH_NAME_PATTERN, "../x")


# ---------------------------------------------------------------------------- reference table


def _leaf_keys(node, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [key for name, value in node.items() for key in _leaf_keys(value, f"{prefix}{name}.")]
    return [prefix[:-1]]


def test_reference_table_mentions_every_key_once():
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "ppo_trainer.yaml"), resolve=False)
    demo = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "grpo_tiny.yaml"), resolve=False)
    expected = set(_leaf_keys(defaults))
    # optional sections (null in the defaults) get a row of their own plus one per key inside them
    sections = {
        "data.synthetic": SyntheticDataConfig.model_fields,
        "actor_rollout_ref.model.build": demo["actor_rollout_ref"]["model"]["build"],
        "critic.model.build": demo["actor_rollout_ref"]["model"]["build"],
    }
    for section, inner in sections.items():
        assert section in expected
        expected |= {f"{section}.{name}" for name in inner}
    # skip is keyed by stage name: documented once as skip.<stage>.*
    expected = {key.replace("skip.rollout.", "skip.<stage>.") for key in expected}
    assert len(expected) == 200  # the schema's leaves; a new key must be added to ppo_trainer.yaml too

    table = reference_table()
    rows = table.splitlines()
    assert rows[0] == "| key | type | default | meaning |"
    keys = [re.match(r"\| `([^`]+)` \|", row).group(1) for row in rows[2:]]
    assert len(keys) == len(set(keys)), "a key is listed twice"
    assert set(keys) == expected
    for key in expected:
        assert table.count(f"| `{key}` |") == 1, key
    by_key = dict(zip(keys, rows[2:]))
    assert "| int | `16` |" in by_key["data.train_batch_size"]
    assert '`"~/.verl/rollout_dump"`' in by_key["skip.<stage>.dump_dir"]
    assert "| `[]` |" in by_key["skip.<stage>.steps"]


@pytest.mark.parametrize(
    "words, key, message",
    [
        (
            ["actor_rollout_ref.actor.resources.num_gpus=1"],
            "trainer.n_gpus_per_node",
            "the training roles reserve 1 GPUs (1 rank x (actor_rollout_ref.actor.resources.num_gpus=1)) but "
            "the training pool has trainer.nnodes * trainer.n_gpus_per_node = 0",
        ),
        # each of the W ranks of a training role reserves the role's GPUs
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.resources.num_gpus=1",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.ref.resources.num_gpus=0.5",
            ],
            "trainer.n_gpus_per_node",
            "the training roles reserve 3 GPUs (2 ranks x (actor_rollout_ref.actor.resources."
            "num_gpus=1 + actor_rollout_ref.ref.resources.num_gpus=0.5)) but the training pool has "
            "trainer.nnodes * trainer.n_gpus_per_node = 2",
        ),
        (
            ["actor_rollout_ref.rollout.resources.num_gpus=1"],
            "rollout.n_gpus_per_node",
            "actor_rollout_ref.rollout.resources.num_gpus=1 exceeds the rollout pool "
            "rollout.nnodes * rollout.n_gpus_per_node = 0",
        ),
        (
            [
                "trainer.mode=one_step_off",
                "rollout.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.resources.num_gpus=1",
            ],
            "rollout.n_gpus_per_node",
            "one_step_off needs both pools on GPUs or both on CPUs (training pool 0 GPUs, rollout pool 1)",
        ),
        (
            ["actor_rollout_ref.rollout.weight_sync.backend=nccl"],
            "actor_rollout_ref.rollout.weight_sync.backend",
            "nccl moves weights between GPUs; the actor and the rollout both need resources.num_gpus > 0 "
            "(use object_store or gloo on CPUs)",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold='3_1'",
            ],
            "algorithm.rollout_correction.rollout_is_threshold",
            "Invalid threshold '3_1': the lower bound exceeds the upper bound.",
        ),
        (
            ["algorithm.rollout_correction.rollout_rs=token_k2"],
            "algorithm.rollout_correction.rollout_rs_threshold",
            "rollout_rs='token_k2' needs thresholds",
        ),
        # a problem of the options names rollout_rs, one of their bounds rollout_rs_threshold
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k9",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0",
            ],
            "algorithm.rollout_correction.rollout_rs",
            "Unknown rollout rejection option 'token_k9'",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2,seq_max_k3",
                "algorithm.rollout_correction.rollout_rs_threshold=[1.0,2.0,3.0]",
            ],
            "algorithm.rollout_correction.rollout_rs_threshold",
            "rollout rejection: got 3 thresholds for 2 options",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=sequence"],
            "algorithm.rollout_correction.bypass_mode",
            "bypass mode uses the rollout's log-probs as old log-probs, so rollout_is / rollout_rs (old vs rollout) "
            "have nothing to correct; set bypass_mode=false",
        ),
        (
            ["trainer.resume_mode=resume_path", "trainer.resume_from_path=somewhere"],
            "trainer.resume_from_path",
            "resume_mode=resume_path needs a .../global_step_N directory",
        ),
    ],
)
def test_resource_correction_and_resume_rules(words, key, message):
    problem_key, problem = only_problem(words)
    assert problem_key == key and problem.startswith(message)


def test_verl_pool_rule_and_the_mini_batch_split_both_report_indivisible_batches():
    # 3 x 3 = 9 trajectories neither fill 4 GPUs evenly (verl's pool rule) nor split over 4 ranks
    assert problems_of(
        "grpo_tiny",
        [
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.rollout.n=3",
            "data.train_batch_size=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        ],
    ) == [
        (
            "actor_rollout_ref.rollout.n",
            "with 4 training GPUs, rollout.n=3 must divide the GPU count, or rollout.n * "
            "data.train_batch_size must be divisible by it",
        ),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "mini-batches of 3 x rollout.n=3 = 9 trajectories cannot be "
            "split evenly over 4 training ranks (W = 4 from trainer.nnodes=1 x trainer.n_gpus_per_node=4)",
        ),
    ]


def test_verl_pool_rule_accepts_divisible_batches():
    cfg = load_config("grpo_tiny", ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.resources.num_gpus=1"])
    assert cfg.trainer.n_gpus_per_node == 4  # 8 responses per prompt divide 4 GPUs
