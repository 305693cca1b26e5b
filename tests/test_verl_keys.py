"""configs/verl_keys.py: verl's key names get "did you mean" by meaning, not by spelling."""

from __future__ import annotations

import re

import pytest

from ppoflow.configs import ConfigError, load_config, reference_table
from ppoflow.configs.verl_answers import ANY, NO_OPS
from ppoflow.configs.verl_keys import RENAMED, UNSUPPORTED
from tests.preflight_helpers import assert_user_error, run_cli

OUR_KEYS = set(re.findall(r"^\| `([^`]+)` \|", reference_table(), re.MULTILINE))
TABLE = {**RENAMED, **UNSUPPORTED}


def load_problems(words: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        load_config("grpo_tiny", words)
    return caught.value.problems


def test_renamed_keys_point_at_keys_of_the_schema():
    targets = [target for ours in RENAMED.values() for target in ([ours] if isinstance(ours, str) else ours)]
    assert [target for target in targets if target not in OUR_KEYS] == []


def test_the_table_holds_only_keys_the_schema_lacks_and_no_entry_inside_another():
    assert set(RENAMED).isdisjoint(UNSUPPORTED)
    assert [key for key in TABLE if key in OUR_KEYS or any(ours.startswith(f"{key}.") for ours in OUR_KEYS)] == []
    assert [(key, other) for key in TABLE for other in TABLE if other.startswith(f"{key}.")] == []
    reasons = ("not supported", "planned, not supported yet", "not needed")
    assert [key for key, why in UNSUPPORTED.items() if not why.startswith(reasons)] == []


def test_every_entry_is_answered_in_one_round():
    """Every entry set to 1: refused by name in one round, but where any value changes nothing (accepted)."""
    problems = load_problems([f"{key}=1" for key in TABLE])
    accepted = {key for key, values in NO_OPS.items() if values is ANY}
    assert len(problems) == len(set(TABLE) - accepted)
    answers = dict(problems)
    for key, ours in RENAMED.items():
        named = " and ".join(repr(target) for target in ([ours] if isinstance(ours, str) else ours))
        assert answers[key].startswith(f"unknown key; did you mean {named}?"), key
    for key, why in UNSUPPORTED.items():
        assert key in accepted or answers[key].startswith(f"unknown key; verl's key, {why}"), key


@pytest.mark.reliability
@pytest.mark.parametrize(
    "word, answer",
    [
        # the three: difflib offered the dual-clip constant, the reward cache and the trainer mode
        (
            "actor_rollout_ref.actor.clip_ratio=0.2",
            "did you mean 'actor_rollout_ref.actor.clip_ratio_low' and 'actor_rollout_ref.actor.clip_ratio_high'?",
        ),
        ("reward_model.nnodes=1", "verl's key, not supported: the reward model has a worker of its own"),
        ("trainer.device=cuda", "verl's key, not supported: the device follows the resources"),
        ("actor_rollout_ref.model.use_liger=True", "verl's key, not supported: models run on plain transformers"),
    ],
)
def test_the_command_line_answers_verls_keys_by_meaning(capsys, word, answer):
    key = word.partition("=")[0]
    code, stderr = run_cli(capsys, "config", word)
    assert_user_error(code, stderr, f"  {key}: unknown key; {answer}")
    assert "clip_ratio_c" not in stderr and "skip.reward" not in stderr and "trainer.mode" not in stderr


def test_a_key_inside_an_unknown_section_gets_its_own_answer():
    problems = load_problems(
        [
            "critic.fsdp.param_offload=True",
            "critic.fsdp.fsdp_size=-1",
            "ray_kwargs.ray_init.num_cpus=4",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model]",
            "ray_kwargs.zzz=1",
        ]
    )
    assert [key for key, _ in problems] == [
        "actor_rollout_ref.actor.checkpoint",
        "critic.fsdp.param_offload",
        "critic.fsdp.fsdp_size",
        "ray_kwargs.ray_init.num_cpus",
        "ray_kwargs",
    ]
    assert dict(problems)["critic.fsdp.param_offload"].startswith(
        "unknown key; did you mean 'critic.fsdp_config.offload_policy'?"
    )
    assert dict(problems)["ray_kwargs"] == "unknown key"  # what is left of the section: no key of verl's, no typo


def test_typos_of_our_own_keys_still_get_the_closest_spelling():
    assert load_problems(["actor_rollout_ref.rollout.temprature=0.5"]) == [
        ("actor_rollout_ref.rollout.temprature", "unknown key; did you mean 'actor_rollout_ref.rollout.temperature'?")
    ]


VERL_GRPO_EXAMPLE = [  # verl's examples/grpo_trainer/run_qwen3_4b_fsdp.sh, its paths and sizes made small
    "algorithm.adv_estimator=grpo",
    "data.train_files=/data/train.parquet",
    "data.val_files=/data/test.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=64",
    "data.max_response_length=64",
    "data.filter_overlong_prompts=True",
    "data.truncation='error'",
    "algorithm.use_kl_in_reward=False",
    "actor_rollout_ref.model.path=/models/qwen",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3000",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.enable_chunked_prefill=False",
    "actor_rollout_ref.rollout.enforce_eager=False",
    "actor_rollout_ref.rollout.free_cache_engine=True",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192",
    "trainer.critic_warmup=0",
    "trainer.logger=[console]",
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen3_4b",
    "trainer.n_gpus_per_node=0",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
VERL_PPO_EXTRA = [  # and what examples/ppo_trainer/run_qwen3_8b_fsdp.sh adds for the critic
    "algorithm.adv_estimator=gae",
    "critic.model.path=/models/qwen",
    "critic.model.use_remove_padding=True",
    "critic.model.enable_gradient_checkpointing=True",
    "critic.optim.lr=1e-5",
    "critic.use_dynamic_bsz=True",
    "critic.ppo_max_token_len_per_gpu=3000",
    "critic.fsdp.param_offload=False",
    "critic.fsdp.optimizer_offload=False",
    "trainer.balance_batch=True",
    "actor_rollout_ref.actor.clip_ratio=0.2",
]


@pytest.mark.parametrize("words", [VERL_GRPO_EXAMPLE, VERL_GRPO_EXAMPLE + VERL_PPO_EXTRA], ids=["grpo", "ppo"])
def test_verls_example_command_lines_get_an_answer_for_every_key(words):
    problems = load_problems(words)
    unknown = [(key, message) for key, message in problems if message.startswith("unknown key")]
    assert [key for key, message in unknown if key not in TABLE] == []  # each unknown key is one of verl's ...
    assert {key for key, _ in problems} == {key for key, _ in unknown}  # ... and every other key is ours, and fits
    ours = [word for word in words if word.partition("=")[0] not in TABLE]
    assert load_config("grpo_tiny", ours).trainer.experiment_name == "qwen3_4b"  # what is left loads as it is
