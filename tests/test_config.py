"""configs/: YAML defaults and presets, build and synthetic recipes, verl's defaults, key=value overrides, the
reference table. Refused values: tests/test_config_errors.py; cross-field rules: tests/test_config_rules.py;
names that become paths: tests/test_config_names.py; every numeric range: tests/test_config_ranges.py."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pydantic
import pytest
from omegaconf import OmegaConf

from ppoflow.configs import CONFIG_DIR, load_config, preset_names, reference_table
from ppoflow.configs.schema import SyntheticDataConfig
from tests.config_helpers import only_problem, problems_of

DEMO_PATHS = ["data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet"]


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
    assert preset_names() == ["dapo_tiny", "grpo_tiny", "ppo_trainer", "vault_tool"]


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


def test_an_edited_yaml_file_is_read_anew_and_a_load_leaves_the_shared_defaults_alone(tmp_path):
    path = tmp_path / "mine.yaml"

    def temperature(words=()):
        return load_config(str(path), list(words)).actor_rollout_ref.rollout.temperature

    preset = "data:\n  train_files: /d/t.jsonl\nactor_rollout_ref:\n  model:\n    path: /m\n  rollout:\n"
    path.write_text(f"{preset}    temperature: 0.5\n")
    assert temperature(["actor_rollout_ref.rollout.temperature=0.7"]) == 0.7
    assert temperature() == 0.5  # the override changed no shared copy
    path.write_text(f"{preset}    temperature: 0.25\n")  # another size: read anew
    assert temperature() == 0.25


def test_a_relative_yaml_path_read_from_another_directory_is_another_file(tmp_path, monkeypatch):
    preset = "data:\n  train_files: /d/t.jsonl\nactor_rollout_ref:\n  model:\n    path: /m\n  rollout:\n"
    for name, value in (("a", "0.5"), ("b", "0.4")):  # the same size and modification time
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.yaml").write_text(f"{preset}    temperature: {value}\n")
        os.utime(tmp_path / name / "mine.yaml", ns=(0, 0))
    temperatures = []
    for name in ("a", "b"):
        monkeypatch.chdir(tmp_path / name)
        temperatures.append(load_config("mine.yaml").actor_rollout_ref.rollout.temperature)
    assert temperatures == [0.5, 0.4]


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
    assert len(expected) == 318  # the schema's leaves; a new key must be added to ppo_trainer.yaml too

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
