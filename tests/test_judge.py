"""The LLM judge on the rollout service (reward_model.judge): the tiny policy's own replicas generate each verdict
as trajectories finish, a user parser turns it into a score, a parser failure scores error_score and is counted;
its config is checked before anything starts."""

import json

import pytest

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from tests.config_helpers import only_problem
from tests.conftest import small_run

PARSER = """
def parse(data_source, solution_str, ground_truth, extra_info=None):
    if any(digit in solution_str for digit in "01234"):
        raise ValueError("no score in this verdict")
    return {"score": float(len(solution_str)), "length": float(len(solution_str))}
"""


def test_a_judge_scores_each_trajectory_on_the_rollout_replicas(prefect_api, ray_local, tiny_model, tmp_path):
    (tmp_path / "parser.py").write_text(PARSER)
    overrides = small_run(tiny_model, tmp_path) + [
        "actor_rollout_ref.rollout.mode=async",
        "data.val_files=null",
        "data.synthetic.task=prefer",  # no rule scores it: the judge alone
        "trainer.test_freq=-1",
        f"trainer.rollout_data_dir={tmp_path}/dumps",
        "reward_model.judge.prompt_template='{prompt}{response}?'",
        f"reward_model.judge.parser_path={tmp_path}/parser.py",
        "reward_model.judge.max_tokens=4",
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
