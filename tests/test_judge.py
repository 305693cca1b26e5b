"""The LLM judge on the rollout service (reward_model.judge): the tiny policy's own replicas, or a judge model's
own, generate each verdict as trajectories finish, a user parser turns it into a score, a parser failure scores
error_score and is counted; its config is checked before anything starts."""

import json

import pytest
import torch

from ppoflow.configs.schema import TinyModelConfig
from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from ppoflow.workers.models import build_tiny_model
from tests.config_helpers import only_problem
from tests.conftest import small_run

PARSER = """
def parse(data_source, solution_str, ground_truth, extra_info=None):
    if any(digit in solution_str for digit in "01234"):
        raise ValueError("no score in this verdict")
    return {"score": float(len(solution_str)), "length": float(len(solution_str))}
"""


def judged_run(tiny_model: str, tmp_path, parser: str) -> list[str]:
    """Two steps of the prefer task (no rule scores it: the judge alone) in async mode, each verdict of at most 4
    tokens parsed by ``parser`` (written under ``tmp_path``), the scored samples dumped to ``tmp_path/dumps``."""
    (tmp_path / "parser.py").write_text(parser)
    return small_run(tiny_model, tmp_path) + [
        "actor_rollout_ref.rollout.mode=async",
        "data.val_files=null",
        "data.synthetic.task=prefer",
        "trainer.test_freq=-1",
        f"trainer.rollout_data_dir={tmp_path}/dumps",
        "reward_model.judge.prompt_template='{prompt}{response}?'",
        f"reward_model.judge.parser_path={tmp_path}/parser.py",
        "reward_model.judge.max_tokens=4",
    ]


def test_a_judge_scores_each_trajectory_on_the_rollout_replicas(prefect_api, ray_local, tiny_model, tmp_path):
    overrides = judged_run(tiny_model, tmp_path, PARSER) + [
        "reward_model.judge.temperature=1.0",
        "reward_model.judge.error_score=-5",
    ]
    state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    outcomes = set()
    rows = read_metrics(str(tmp_path / "run"))
    for row in rows:
        assert "timing_s/reward" not in row  # scored while generating
        assert "reward/judge_length/mean" in row
    for step, row in zip((1, 2), rows):
        scores = [json.loads(line)["score"] for line in open(tmp_path / "dumps" / f"{step}.jsonl")]
        failed = [score == -5.0 for score in scores]  # error_score; a verdict the parser scored: its length >= 0
        assert all(score >= 0 and score == int(score) for score, bad in zip(scores, failed) if not bad)
        assert row["reward/judge_scorer_errors/mean"] == pytest.approx(sum(failed) / len(scores))
        outcomes.update(failed)
    assert outcomes == {True, False}  # verdicts the parser scored, and verdicts it failed on


SEVENS_PARSER = """
def parse(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0 if solution_str == "7777" else 0.0, "sevens": float(solution_str.count("7"))}
"""


def build_sevens_judge(path) -> None:
    """A tiny judge model whose greedy verdict is always ``7777``: its embeddings share one large coordinate, which
    the final norm keeps positive, and its output head reads only that coordinate, for the token ``7`` alone.
    Built from a config and saved like any Hugging Face model, so it is loaded through the real code."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(
        str(path),
        TinyModelConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=128,
            seed=1,
        ),
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    seven = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("7")
    model.config.tie_word_embeddings = False  # the tiny models tie them: the head gets weights of its own
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 100.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[seven, 0] = 1.0
    model.save_pretrained(path)


@pytest.mark.slow  # a model worker of its own (~17 s); the judge on the rollout's replicas runs by default
def test_a_judge_model_of_its_own_scores_on_its_replicas(prefect_api, ray_local, tiny_model, tmp_path):
    """The judge model (always ``7777``) judges every trajectory of both steps on its own replicas, in its own
    tokens: the policy, judging, would say something else, and the judge's replicas would too had they been sent
    the policy's weights after step 1."""
    build_sevens_judge(tmp_path / "judge")
    overrides = judged_run(tiny_model, tmp_path, SEVENS_PARSER) + [
        f"reward_model.judge.model.path={tmp_path}/judge",
        "reward_model.judge.num_replicas=2",
        "reward_model.judge.resources.num_cpus=0",
    ]
    state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["reward/judge_sevens/mean"] for row in rows] == [4.0, 4.0]
    for step in (1, 2):
        scores = [json.loads(line)["score"] for line in open(tmp_path / "dumps" / f"{step}.jsonl")]
        assert scores == [1.0] * 16


@pytest.mark.parametrize(
    "words, key, message",
    [
        (
            ["reward_model.judge.prompt_template='{answer}'"],
            "reward_model.judge.prompt_template",
            "names answer",
        ),
        (
            ["reward_model.judge.prompt_template='{response}'", "reward_model.judge.parser_path=p.py"],
            "reward_model.judge.prompt_template",
            "needs actor_rollout_ref.rollout.mode=async",
        ),
        (
            ["reward_model.judge.prompt_template='{response}'", "actor_rollout_ref.rollout.mode=async"],
            "reward_model.judge.parser_path",
            "needed with a judge",
        ),
    ],
)
def test_judge_settings_are_checked(words, key, message):
    found_key, found = only_problem(words)
    assert found_key == key and message in found, found


def test_the_reward_model_stage_is_cached_only_where_it_runs():
    key, message = only_problem(["skip.reward_model.enable=true", "skip.reward_model.steps=[1]"])
    assert key == "skip.reward_model.enable" and "no reward_model stage to cache" in message
