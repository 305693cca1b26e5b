"""Reward scorers that fail: in the trainer, in a scorer process, and in a run. A plain scorer's failure
raises; a run's scorers (built-in or custom) score a failed response ``custom_reward_function.error_score``,
logged once per distinct message per batch and counted, and the run goes on. Scorers that hang:
tests/test_scoring_timeouts.py."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import pytest
import torch

from ppoflow.algorithms.scoring import (
    BuiltinScorers,
    ScorerFailed,
    ScorerUnavailable,
    score_one,
    score_responses,
)
from ppoflow.workers.service.scorer_process import ScorerProcess
from tests.conftest import model_config

# ------------------------------------------------------------------------ scorers that fail

BAD_SCORERS = """
import os

def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("judge_url")

def returns_text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"accuracy": 1.0}

def exits_on_the_second(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "second":
        os._exit(3)
    return 0.5

def by_response(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("judge_url")
    if solution_str == "exit":
        os._exit(3)
    return {"nan": float("nan"), "inf": {"score": 1.0, "margin": float("-inf")}, "text": "1.0"}.get(solution_str, 0.5)
"""


@pytest.mark.reliability
@pytest.mark.parametrize(
    "result, message",
    [
        ("1.0", "returned a str ('1.0'), not a number or a dict with a number under 'score'"),
        (None, "returned None, not a number"),
        ({"accuracy": 1.0}, "returned a dict without 'score' (keys: 'accuracy')"),
        ({"score": 1.0, "note": "ok"}, "returned a dict whose 'note' is a str ('ok')"),
    ],
)
def test_a_return_that_is_not_a_score_names_the_scorer_and_the_response(result, message):
    def judge(data_source, solution_str, ground_truth, extra_info=None):
        return result

    with pytest.raises(ScorerFailed) as caught:
        score_responses(["my/task"], ["x"], ["y"], custom=judge, prompt_ids=["3-1"])
    assert str(caught.value).startswith(
        f"the custom scorer 'test_a_return_that_is_not_a_score_names_the_scorer_and_"
        f"the_response.<locals>.judge' {message}"
    )
    assert str(caught.value).endswith("while scoring a response to prompt '3-1' (data source 'my/task')")


@pytest.mark.reliability
def test_a_builtin_scorer_that_raises_is_a_scorer_failure():
    with pytest.raises(
        ScorerFailed,
        match=r"^the built-in scorer copy_score raised TypeError: .* while scoring "
        r"response 1 \(data source 'synthetic/copy'\)$",
    ):
        score_responses(["synthetic/copy", "synthetic/copy"], ["1", "2"], ["1", 2])


@pytest.mark.reliability
def test_a_scorer_process_reports_what_its_scorer_did(tmp_path):
    path = tmp_path / "bad_reward.py"
    path.write_text(BAD_SCORERS)
    expected = {
        "raises": "raised KeyError: 'judge_url'",
        "returns_text": "returned a str ('1.0'), not a number or a dict with a number under 'score'",
        "no_score": "returned a dict without 'score' (keys: 'accuracy'), not a number or a dict with a number "
        "under 'score'",
        "absent": f"cannot be loaded: {str(path)!r} has no callable 'absent'",
    }
    for name, message in expected.items():
        with ScorerProcess(str(path), name, timeout_s=60) as scorer, pytest.raises(ScorerFailed) as caught:
            score_responses(["my/task"], ["x"], ["y"], scorer, prompt_ids=["2-0"])
        assert isinstance(caught.value, ScorerUnavailable) == (name == "absent")
        assert str(caught.value) == (
            f"the custom scorer '{path}:{name}' {message} while scoring a response to "
            "prompt '2-0' (data source 'my/task')"
        )
    with ScorerProcess(str(path), "exits_on_the_second", timeout_s=60) as scorer:
        with pytest.raises(ScorerFailed) as caught:
            score_responses(["my/task"] * 2, ["first", "second"], ["t", "t"], scorer, prompt_ids=["5-0", "5-1"])
        assert str(caught.value) == (
            f"the custom scorer '{path}:exits_on_the_second' crashed: its process exited "
            "with code 3 while scoring a response to prompt '5-1' (data source 'my/task')"
        )
        assert scorer("my/task", "first", "t") == {"score": 0.5}  # a fresh process took the dead one's place


@pytest.mark.parametrize(
    "solution, message",
    [
        ("nan", "returned score=nan, not a finite number"),
        ("inf", "returned margin=-inf, not a finite number"),
    ],
)
def test_a_non_finite_score_is_a_scorer_failure(tmp_path, solution, message):
    (tmp_path / "bad_reward.py").write_text(BAD_SCORERS)
    with ScorerProcess(str(tmp_path / "bad_reward.py"), "by_response", timeout_s=60) as scorer:
        with pytest.raises(ScorerFailed) as caught:
            score_responses(["my/task"], [solution], ["y"], scorer, prompt_ids=["1-0"])
    assert str(caught.value) == (
        f"the custom scorer '{tmp_path}/bad_reward.py:by_response' {message} while scoring a response to prompt "
        "'1-0' (data source 'my/task')"
    )


# ------------------------------------------------------------------- a run's scorers score on


@contextmanager
def scoring_warnings(caplog):
    """The scoring module's warnings, in ``caplog`` only (the ppoflow loggers may not propagate to the root)."""
    scoring_logger = logging.getLogger("ppoflow.algorithms.scoring")
    scoring_logger.addHandler(caplog.handler)
    scoring_logger.propagate = False
    try:
        with caplog.at_level(logging.WARNING, logger="ppoflow.algorithms.scoring"):
            yield
    finally:
        scoring_logger.propagate = True
        scoring_logger.removeHandler(caplog.handler)


def test_a_run_scorer_scores_error_score_for_each_failed_response_logs_once_and_counts(tmp_path, caplog):
    """Raised, non-finite, not a score, crashed: each such response scores error_score and counts 1 in
    scorer_errors; each distinct failure is logged once for the batch, naming its first response and how many
    more; the other responses score as usual (a crashed process is replaced)."""
    (tmp_path / "bad_reward.py").write_text(BAD_SCORERS)
    label = f"the custom scorer '{tmp_path}/bad_reward.py:by_response'"
    solutions = ["raise", "ok", "nan", "raise", "inf", "text", "exit", "raise", "ok"]
    with (
        ScorerProcess(str(tmp_path / "bad_reward.py"), "by_response", timeout_s=60, error_score=-0.5) as scorer,
        scoring_warnings(caplog),
    ):
        scores, extras = score_responses(
            ["my/task"] * 9, solutions, ["y"] * 9, scorer, prompt_ids=[f"7-{i}" for i in range(9)]
        )
    assert scores == [-0.5, 0.5, -0.5, -0.5, -0.5, -0.5, -0.5, -0.5, 0.5]
    assert extras == {"scorer_errors": [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]}
    sample = "a response to prompt '7-{}' (data source 'my/task')"
    assert caplog.messages == [
        f"{label} raised KeyError: 'judge_url' while scoring {sample.format(0)} and 2 more responses: scored "
        "custom_reward_function.error_score=-0.5",
        f"{label} returned score=nan, not a finite number while scoring {sample.format(2)}: scored "
        "custom_reward_function.error_score=-0.5",
        f"{label} returned margin=-inf, not a finite number while scoring {sample.format(4)}: scored "
        "custom_reward_function.error_score=-0.5",
        f"{label} returned a str ('1.0'), not a number or a dict with a number under 'score' while scoring "
        f"{sample.format(5)}: scored custom_reward_function.error_score=-0.5",
        f"{label} crashed: its process exited with code 3 while scoring {sample.format(6)}: scored "
        "custom_reward_function.error_score=-0.5",
    ]


def test_a_builtin_scorer_that_raises_scores_error_score_in_a_run():
    scores, extras = score_responses(
        ["synthetic/copy"] * 3, ["1", "2", "12"], [1, "2", "12"], BuiltinScorers(error_score=-1.0)
    )
    assert scores == [-1.0, 1.0, 1.0]  # copy_score cannot iterate the int ground truth 1
    assert extras == {"scorer_errors": [1.0, 0.0, 0.0], "exact": [1.0, 1.0]}


def test_a_scorer_that_cannot_start_fails_whatever_error_score_says(tmp_path):
    (tmp_path / "bad_reward.py").write_text(BAD_SCORERS)
    with ScorerProcess(str(tmp_path / "bad_reward.py"), "absent", timeout_s=60, error_score=0.0) as scorer:
        with pytest.raises(ScorerUnavailable, match="cannot be loaded: .* while scoring response 0"):
            score_responses(["my/task"], ["x"], ["y"], scorer)


def test_one_response_at_a_time_a_failure_is_logged_the_1st_2nd_4th_time(caplog):
    """The rollout service scores each trajectory as it finishes (score_one without a batch): a failure is
    logged the 1st, 2nd, 4th, 8th ... time it happens in the process, never once per response."""
    marker = f"ppoflow-test-{os.getpid()}-{id(caplog)}"  # a message no other test logs

    def judge(data_source, solution_str, ground_truth, extra_info=None):
        raise RuntimeError(marker)

    judge.error_score = 0.0  # a run's scorer
    with scoring_warnings(caplog):
        results = [score_one("my/task", "x", "y", judge, sample=f"response {i}") for i in range(9)]
    assert results == [(0.0, {"scorer_errors": 1.0})] * 9
    logged = [message for message in caplog.messages if marker in message]
    assert [message.split(" while scoring ")[1].split(":")[0] for message in logged] == [
        "response 0",
        "response 1 (seen 2 times in this process)",
        "response 3 (seen 4 times in this process)",
        "response 7 (seen 8 times in this process)",
    ]


SEEING_FAILING_SCORER = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "99":
        raise ValueError("cannot parse " + solution_str)
    return {"score": float(solution_str == ground_truth) + extra_info["index"] / 10, "index": extra_info["index"]}
"""


def test_the_reward_stage_passes_extra_info_and_scores_on_past_a_failing_response(tmp_path, tiny_model, caplog):
    """Through tasks/reward.py in the flow: rows read from a file with their extra_info, a scorer process with the
    run's error_score; the failed response's score sits on its last token, the count is a metric."""
    from ppoflow.configs import load_config
    from ppoflow.data.datasets import load_prompt_dataset, write_rows
    from ppoflow.tasks.reward import reward
    from ppoflow.workers.models import load_tokenizer
    from ppoflow.workers.service.scorer_process import configured_scorer

    rows = [
        {
            "data_source": "my/task",
            "prompt": f"{truth}>",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": index},
        }
        for index, truth in enumerate(["12", "34", "56"])
    ]
    write_rows(str(tmp_path / "rows.parquet"), rows)
    (tmp_path / "my_reward.py").write_text(SEEING_FAILING_SCORER)
    cfg = load_config(
        "grpo_tiny",
        [
            f"data.train_files={tmp_path}/rows.parquet",
            f"custom_reward_function.path={tmp_path}/my_reward.py",
            "custom_reward_function.error_score=-1",
        ],
    )
    tokenizer = load_tokenizer(model_config(tiny_model))
    dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
    batch = dataset.batch([0, 1, 2], ["1-0", "1-1", "1-2"], tokenizer.pad_token_id)
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("12", "99", "5")]
    batch["responses"] = torch.tensor([ids + [tokenizer.pad_token_id] * (3 - len(ids)) for ids in responses])
    batch["response_mask"] = torch.tensor([[i < len(ids) for i in range(3)] for ids in responses])
    scorer = configured_scorer(cfg.custom_reward_function)
    with scorer, scoring_warnings(caplog):
        result = reward.fn(batch, tokenizer, scorer)
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, -1.0, 0.0], [0.2, 0.0, 0.0]])  # 1 + 0/10; error_score; 0 + 2/10
    assert torch.allclose(result.fields["token_level_scores"], expected, atol=1e-6)
    assert result.metrics == {"reward/index/mean": 1.0, "reward/scorer_errors": 1.0}  # index over the two scored
    assert caplog.messages == [
        f"the custom scorer '{tmp_path}/my_reward.py:compute_score' raised ValueError: cannot parse 99 while "
        "scoring a response to prompt '1-1' (data source 'my/task'): scored custom_reward_function.error_score=-1"
    ]


@pytest.mark.reliability
def test_a_run_whose_scorer_exits_the_process_scores_on(tmp_path, tiny_overrides):
    """The scorer passes the preflight and step 1, then ends its process on the first response of step 2: that
    response scores error_score, the next ones are scored by a fresh process, and both steps train, the second
    counting one scorer error."""
    from ppoflow.configs import load_config
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import train

    calls = tmp_path / "calls"
    (tmp_path / "my_reward.py").write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a') as calls:\n"
        "        calls.write('.')\n"
        f"    if os.path.getsize({str(calls)!r}) == 1 + 16 + 1:  # the preflight's row, step 1's 4 x 4, then this\n"
        "        os._exit(3)\n"
        "    return float(solution_str == ground_truth)\n"
    )
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [f"custom_reward_function.path={tmp_path}/my_reward.py", "trainer.test_freq=0", "trainer.save_freq=0"],
    )
    train(cfg, orchestrated=False)
    rows = read_metrics(cfg.trainer.default_local_dir)
    assert [row["reward/scorer_errors"] for row in rows] == [0.0, 1.0]
    assert calls.read_text() == "." * (1 + 16 + 16)  # every response was scored once
