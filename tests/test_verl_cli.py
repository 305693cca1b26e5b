"""verl's command lines: every key of verl's ppo_trainer.yaml and of its GRPO / DAPO example scripts is accepted
or answered by name (configs/verl_keys.py), and verl's chat-template keys reach the template.

The fixtures in tests/data/ come from a verl checkout (scripts/verl_fixtures.py; the commit heads each file).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ppoflow.configs import ConfigError, load_config, reference_table
from ppoflow.configs.normalize import changes_nothing
from ppoflow.configs.verl_keys import RENAMED, UNSUPPORTED
from ppoflow.data.datasets import load_prompt_dataset, write_rows
from tests.conftest import model_config
from tests.datasets_helpers import chat_row, data_config

DATA = Path(__file__).parent / "data"
OUR_KEYS = set(re.findall(r"^\| `([^`]+)` \|", reference_table(), re.MULTILINE))
TABLE = {**RENAMED, **UNSUPPORTED}


def fixture_lines(name: str) -> list[str]:
    return [line for line in (DATA / name).read_text().splitlines() if line and not line.startswith("#")]


VERL_KEYS = dict(line.split("=", 1) for line in fixture_lines("verl_keys.txt"))


def example_scripts() -> dict[str, list[str]]:
    """Each example script's overrides, Hydra's ``+`` dropped to name the keys (the loader takes it too:
    :func:`test_hydra_prefixes_set_the_key`)."""
    scripts: dict[str, list[str]] = {}
    for line in fixture_lines("verl_example_overrides.txt"):
        if line.startswith("["):
            words = scripts.setdefault(line.strip("[]"), [])
        else:
            words.append(line.lstrip("+"))
    return scripts


def problems_of(words: list[str]) -> list[tuple[str, str]]:
    try:
        load_config("grpo_tiny", words)
    except ConfigError as error:
        return error.problems
    return []


def table_entry(key: str) -> str | None:
    """The table's entry for ``key`` or for a section holding it."""
    parts = key.split(".")
    return next((".".join(parts[:end]) for end in range(len(parts), 0, -1) if ".".join(parts[:end]) in TABLE), None)


def test_the_fixture_is_verls_whole_config():
    assert len(VERL_KEYS) > 500  # every leaf, not a sample
    assert {"data.return_raw_chat", "actor_rollout_ref.actor.clip_ratio", "trainer.device"} <= set(VERL_KEYS)


def test_every_key_of_verls_config_is_ours_renamed_or_refused():
    assert [key for key in VERL_KEYS if key not in OUR_KEYS and table_entry(key) is None] == []


def test_every_key_of_verls_config_with_its_default_gets_its_own_answer():
    """verl's defaults (``???`` as null) in one load: every unknown key is answered by the table, by name."""
    words = [f"{key}={'null' if value == '???' else value}" for key, value in VERL_KEYS.items()]
    problems = problems_of(words)
    generic = [(key, why) for key, why in problems if why.startswith("unknown key") and key not in TABLE]
    assert generic == []
    answered = {key for key, why in problems if key in TABLE}
    no_ops = {key for key, value in VERL_KEYS.items() if changes_nothing(key, yaml.safe_load(value))}  # accepted
    assert answered == {table_entry(key) for key in VERL_KEYS if key not in OUR_KEYS and key not in no_ops}
    assert {"trainer.critic_warmup", "actor_rollout_ref.actor.fsdp_config.param_offload"} <= no_ops
    for key in answered:
        why = dict(problems)[key]
        assert why.startswith("unknown key; did you mean" if key in RENAMED else "unknown key; verl's key, not "), key


def test_verls_chat_keys_are_accepted():
    cfg = load_config(
        "grpo_tiny", ["data.return_raw_chat=False", "data.apply_chat_template_kwargs.enable_thinking=False"]
    )
    assert cfg.data.return_raw_chat is False
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert load_config("grpo_tiny").data.apply_chat_template_kwargs == {}  # verl's default


@pytest.mark.parametrize("script", sorted(example_scripts()))
def test_verls_example_scripts_load_once_the_refused_keys_are_dropped(tmp_path, script):
    """Each override of the script is accepted or refused by name; without the refused ones, the config loads."""
    parquet = str(tmp_path / "gsm8k.parquet")
    write_rows(parquet, [chat_row("12", "12", source="openai/gsm8k")])
    # this machine: local data, no GPU (the scripts' vllm rollout and GPU counts are refused by name on a CPU)
    local = {
        "data.train_files": parquet,
        "data.val_files": parquet,
        "actor_rollout_ref.rollout.name": "hf",
        "trainer.n_gpus_per_node": "0",
    }
    words = [
        f"{key}={local.get(key, value)}" for key, _, value in (w.partition("=") for w in example_scripts()[script])
    ]
    problems = problems_of(words)
    given = [word.partition("=")[0] for word in words]
    named = [key for key, _ in problems if any(key == one or one.startswith(f"{key}.") for one in given)]
    assert sorted(named) == sorted(key for key, _ in problems)  # each problem names a key the script sets ...
    assert [(key, why) for key, why in problems if why.startswith("unknown key") and key not in TABLE] == []
    kept = [word for word, key in zip(words, given) if not any(key == k or key.startswith(f"{k}.") for k in named)]
    assert problems_of(kept) == []  # ... and what is left loads as it is
    assert load_config("grpo_tiny", kept).data.train_files == parquet


def test_apply_chat_template_kwargs_reach_the_chat_template(tmp_path, tiny_model):
    from ppoflow.workers.models import load_tokenizer

    tokenizer = load_tokenizer(model_config(tiny_model))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking is defined and not "
        "enable_thinking %}|{% endif %}{% if add_generation_prompt %}a:{% endif %}"
    )
    write_rows(str(tmp_path / "p.jsonl"), [chat_row("12", "12")])
    thinking = load_prompt_dataset(str(tmp_path / "p.jsonl"), data_config(), tokenizer, key="data.train_files")
    quiet = load_prompt_dataset(
        str(tmp_path / "p.jsonl"),
        data_config(apply_chat_template_kwargs={"enable_thinking": False}),
        tokenizer,
        key="data.train_files",
    )
    # the tiny character tokenizer: digit d -> 4 + d, '|' -> 20, 'a' -> 22, ':' -> 18
    assert thinking.prompt_ids == [[5, 6, 22, 18]]
    assert quiet.prompt_ids == [[5, 6, 20, 22, 18]]


def test_hydra_prefixes_set_the_key():
    """verl's scripts add keys with Hydra's ``+key=value`` / ``++key=value``: here every key has a default."""
    plain = load_config("grpo_tiny", ["data.seed=7"])
    assert load_config("grpo_tiny", ["+data.seed=7"]) == plain == load_config("grpo_tiny", ["++data.seed=7"])


PPO_SCRIPT = [  # the shape of verl's examples/ppo_trainer scripts: a model, a critic, data, and little else
    "algorithm.adv_estimator=gae",
    "data.train_files=/home/user/data/gsm8k/train.parquet",
    "data.val_files=/home/user/data/gsm8k/test.parquet",
    "data.train_batch_size=256",
    "actor_rollout_ref.model.path=/home/user/models/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "critic.model.path=/home/user/models/Qwen2.5-0.5B-Instruct",
    "critic.optim.lr=1e-5",
    "trainer.total_epochs=15",
]


def test_a_command_line_naming_its_model_gets_verls_defaults_not_the_demos(capsys):
    """The demo is what ``ppoflow train`` runs alone; a verl script's command line (it names its own model) gets
    verl's defaults for every key it leaves out, and the run's first line says which preset applies."""
    from ppoflow.configs import DEFAULTS_NAME, preset_for, preset_line

    cfg = load_config(None, PPO_SCRIPT)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (actor.entropy_coeff, rollout.n) == (0.0, 1)
    assert (tuple(actor.optim.betas), actor.optim.weight_decay) == ((0.9, 0.999), 0.01)
    assert cfg.trainer.total_training_steps is None and cfg.trainer.total_epochs == 15  # the epochs count
    assert cfg.actor_rollout_ref.model.build is None and cfg.data.synthetic is None  # no demo recipes either
    assert preset_for(None, PPO_SCRIPT) == DEFAULTS_NAME and preset_line(None, PPO_SCRIPT).startswith(
        "config: verl's defaults (configs/ppo_trainer.yaml) and 10 overrides"
    )
    assert (
        load_config(
            None, ["+actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]
        ).actor_rollout_ref.rollout.n
        == 1
    )  # Hydra's +
    demo = load_config(None, ["trainer.total_training_steps=3"])
    assert demo.actor_rollout_ref.rollout.n == 8 and demo.actor_rollout_ref.actor.entropy_coeff == 0.05
    assert (
        preset_line("grpo_tiny", PPO_SCRIPT) == "config: the grpo_tiny preset (the demo; a command line that "
        "sets actor_rollout_ref.model.path gets verl's defaults) and 10 overrides"
    )


def test_verls_no_op_values_are_accepted_and_other_values_say_what_is():
    """Values of verl's keys that leave the run as it is (15 of 21 verl scripts set trainer.critic_warmup=0) load;
    one that would change what runs is refused, saying what verl would do and which value is accepted."""
    no_ops = [
        "trainer.critic_warmup=0",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        "critic.model.fsdp_config.param_offload=False",
        "trainer.use_legacy_worker_impl=auto",
        "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True",
        "ray_kwargs.timeline_json_file=null",
    ]
    assert load_config("grpo_tiny", no_ops) == load_config("grpo_tiny")
    problems = dict(problems_of(["trainer.critic_warmup=5", "actor_rollout_ref.ref.fsdp_config.param_offload=True"]))
    assert problems["trainer.critic_warmup"].endswith(
        "verl would update only the critic for that many steps; here the actor trains from the first step; 0 changes "
        "nothing here and is accepted"
    )
    assert (
        "'actor_rollout_ref.ref.fsdp_config.offload_policy'"
        in problems["actor_rollout_ref.ref.fsdp_config.param_offload"]
    )
    assert problems_of(["trainer.critic_warmup=false"]) != []  # a bool is not the count 0


def test_verls_values_for_our_keys_mean_what_ours_do():
    cfg = load_config(
        "grpo_tiny",
        ["trainer.logger=console", "reward_model.reward_manager=dapo", "actor_rollout_ref.actor.strategy=fsdp"],
    )
    assert cfg.trainer.logger == ["console"]  # verl takes one logger as a string
    assert cfg.reward_model.reward_manager == "naive"  # DAPO's manager: the rule score, its overlong shaping apart
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2"  # verl's FSDP1 trains what FSDP2 does


def test_verls_fully_async_keys_point_at_separate_async():
    problems = dict(
        problems_of(
            [
                "async_training.staleness_threshold=0.1",
                "async_training.trigger_parameter_sync_step=4",
                "async_training.require_batches=1",
                "rollout.total_rollout_steps=100",
                "rollout.total_epochs=2",
            ]
        )
    )
    assert "'trainer.v1.separate_async.parameter_sync_step'" in problems["async_training.trigger_parameter_sync_step"]
    assert "'trainer.total_epochs'" in problems["rollout.total_epochs"]
    for key in ("async_training.staleness_threshold", "async_training.require_batches", "rollout.total_rollout_steps"):
        assert "verl's fully async entry is trainer.mode=separate_async here" in problems[key], key


def test_verls_hydra_flags_and_entry_points_run_as_they_are(capsys, tmp_path):
    """``python3 -m <verl entry> --config-path=... --config-name=...`` with ``ppoflow train`` in front: verl's own
    configs stand for a trainer mode, a Megatron one is refused by name, and a user's own Hydra YAML is read as verl
    reads it (``hydra:`` dropped, ``defaults:`` first, another file of its folder included)."""
    from ppoflow.configs.verl_entries import verl_command
    from tests.preflight_helpers import assert_user_error, run_cli

    words = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]

    def loaded(config_path=None, config_name=None, entry=None):
        config, overrides, _ = verl_command(None, config_path, config_name, entry, words)
        return load_config(config, overrides)

    assert loaded(config_name="ppo_trainer") == load_config(None, words)
    assert loaded(config_path="/verl/recipe/dapo/config", config_name="dapo_trainer.yaml").trainer.mode == "sync"
    one_step_off = loaded(config_path="config", config_name="one_step_off_ppo_trainer")
    assert one_step_off.trainer.mode == "one_step_off"
    assert loaded(entry="recipe.one_step_off_policy.main_ppo").trainer.mode == "one_step_off"
    _, _, implied = verl_command(None, None, None, "verl.experimental.fully_async_policy.fully_async_main", words)
    assert implied == ["trainer.mode=separate_async", "actor_rollout_ref.rollout.mode=async"]

    (tmp_path / "base.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n    n: 5\n"
    )
    (tmp_path / "my_run.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - base\n  - _self_\ndata:\n  train_batch_size: 64\n"
    )
    mine = loaded(config_path=str(tmp_path), config_name="my_run")
    assert (mine.actor_rollout_ref.rollout.n, mine.data.train_batch_size) == (5, 64)
    (tmp_path / "typo.yaml").write_text("defaults:\n  - ppo_trainer\ndata:\n  train_batch_sise: 64\n")
    assert [key for key, _ in problems_of_loaded(lambda: loaded(str(tmp_path), "typo"))] == ["data.train_batch_sise"]

    code, stderr = run_cli(capsys, "config", "--config-name=ppo_megatron_trainer", *words)
    assert_user_error(code, stderr, "--config-name: ppo_megatron_trainer: verl's Megatron config: not supported")
    code, stderr = run_cli(capsys, "config", "--entry", "verl.trainer.main_grpo", *words)
    assert_user_error(code, stderr, "--entry: 'verl.trainer.main_grpo' is not one of verl's entry points")


def problems_of_loaded(load) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as raised:
        load()
    return raised.value.problems
