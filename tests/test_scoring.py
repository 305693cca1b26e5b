"""Rule-based reward scorers, their choice by data_source, custom scorers from config, and scorers that fail
or hang: in the trainer, in a scorer process, and in a run."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

import pytest

from ppoflow.algorithms.scoring import (
    ScorerFailed,
    ScorerTimedOut,
    copy_score,
    gsm8k_score,
    load_custom_scorer,
    score_responses,
    scorer_for,
    vault_score,
)
from ppoflow.storage import bounded
from ppoflow.workers.service.scorer_process import ScorerProcess

# ------------------------------------------------------------------------------------- copy


@pytest.mark.parametrize(
    "solution, truth, score, exact",
    [
        ("60", "60", 1.0, 1.0),  # (2 digits + stop) / 3
        ("6", "60", 1 / 3, 0.0),  # first digit only, stopped too early
        ("61", "60", 2 / 3, 0.0),  # right length, one digit wrong
        ("06", "60", 1 / 3, 0.0),  # right length, both digits wrong
        ("601", "60", 2 / 3, 0.0),  # both digits, no stop
        ("6000", "60", 2 / 3, 0.0),
        ("", "60", 0.0, 0.0),  # nothing
        ("x0", "60", 2 / 3, 0.0),
        ("1234", "1234", 1.0, 1.0),
        ("1243", "1234", 3 / 5, 0.0),  # 2 leading matches + stop over 5
        ("", "", 1.0, 1.0),  # empty truth: only the stop counts
    ],
)
def test_copy_score(solution, truth, score, exact):
    result = copy_score("synthetic/copy", solution, truth)
    assert set(result) == {"score", "exact"}
    assert result["score"] == pytest.approx(score, abs=1e-12)
    assert result["exact"] == exact


@pytest.mark.parametrize(
    "solution, score",
    [
        ("?=58>58", 1.0),  # called the tool, copied its answer
        ("58", 1.0),  # knew it
        ("?=58>5", 0.0),  # no partial credit
        ("?=58>58?=58>", 0.0),  # asked again, never answered
        ("37", 0.0),
        ("?=error: raised>58", 1.0),  # the answer after the last tool answer counts, whatever the tool said
    ],
)
def test_vault_score_is_the_final_answer_exactly(solution, score):
    assert vault_score("synthetic/vault", solution, "58") == {"score": score, "exact": score}


# ------------------------------------------------------------------------------------ gsm8k


@pytest.mark.parametrize(
    "solution, truth, score",
    [
        ("so the answer is\n#### 42", "42", 1.0),
        ("#### 42", "41", 0.0),
        ("#### 1,234", "1234", 1.0),  # commas in the answer are ignored
        ("#### 1234", "1,234", 1.0),  # and in the ground truth
        ("#### 42.", "42", 1.0),  # a sentence-ending period is not part of the number
        ("#### -7", "-7", 1.0),
        ("#### 3.5", "3.5", 1.0),
        ("#### 7 then #### 8", "8", 1.0),  # the last answer counts
        ("#### 7 then #### 8", "7", 0.0),
        ("the answer is 42", "42", 0.0),  # no #### marker
        ("####42", "42", 0.0),  # strict: a space after ####
        ("", "42", 0.0),
        ("#### 42", 42, 1.0),  # a numeric ground truth is compared as text
    ],
)
def test_gsm8k_score(solution, truth, score):
    result = gsm8k_score("openai/gsm8k", solution, truth)
    assert isinstance(result, float)
    assert result == score


# ---------------------------------------------------------------------------- score_responses


def test_score_responses_with_builtin_scorers_collects_extras():
    scores, extras = score_responses(
        ["synthetic/copy", "synthetic/copy", "openai/gsm8k", "synthetic/copy"],
        ["60", "6", "#### 5", "123"],
        ["60", "60", "5", "12"],
    )
    assert scores == pytest.approx([1.0, 1 / 3, 1.0, 2 / 3])
    assert extras == {"exact": [1.0, 0.0, 0.0]}  # only the dict scorer reports `exact`


def test_score_responses_with_a_float_custom_scorer():
    calls = []

    def length_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((data_source, solution_str, ground_truth))
        return len(solution_str)

    scores, extras = score_responses(["anything", "other"], ["abc", ""], [None, "t"], custom=length_score)
    assert scores == [3.0, 0.0] and all(isinstance(score, float) for score in scores)
    assert extras == {}
    assert calls == [("anything", "abc", None), ("other", "", "t")]


def test_score_responses_with_a_dict_custom_scorer():
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 0.5 if solution_str == ground_truth else -0.5, "length": len(solution_str), "flag": True}

    scores, extras = score_responses(["a", "a", "a"], ["x", "yy", ""], ["x", "x", ""], custom=scorer)
    assert scores == [0.5, -0.5, 0.5]
    assert extras == {"length": [1.0, 2.0, 0.0], "flag": [1.0, 1.0, 1.0]}
    assert score_responses([], [], []) == ([], {})


def test_unknown_data_source():
    with pytest.raises(ValueError) as caught:
        score_responses(["synthetic/copy", "my/task"], ["1", "2"], ["1", "2"])
    assert str(caught.value) == (
        "no reward scorer for data_source 'my/task'; built-ins: synthetic/copy, "
        "synthetic/vault, openai/gsm8k; or set custom_reward_function.path"
    )
    assert scorer_for("synthetic/copy", None) is copy_score
    assert scorer_for("openai/gsm8k", None) is gsm8k_score
    custom = lambda *args, **kwargs: 0.0  # noqa: E731
    assert scorer_for("my/task", custom) is custom
    assert scorer_for("synthetic/copy", custom) is custom


# ---------------------------------------------------------------------------- custom scorers

MODULE_TEXT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else 0.25

def other(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 7.0, "source_length": len(data_source)}

not_callable = 3
"""


@pytest.fixture
def scorer_module(tmp_path, monkeypatch):
    """A module ``ppoflow_test_scorers_<id>`` importable from sys.path; returns its name."""
    name = f"ppoflow_test_scorers_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE_TEXT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_module_colon_function(scorer_module):
    scorer = load_custom_scorer(f"{scorer_module}:other", "compute_score")  # the name is ignored
    assert scorer.__name__ == "other"
    assert scorer("abc", "x", "y") == {"score": 7.0, "source_length": 3}
    assert score_responses(["abc"], ["x"], ["y"], custom=scorer) == ([7.0], {"source_length": [3.0]})


def test_module_plus_name(scorer_module):
    scorer = load_custom_scorer(scorer_module, "compute_score")
    assert scorer("d", "1", "1") == 1.0 and scorer("d", "1", "2") == 0.25
    assert load_custom_scorer(scorer_module, "other").__name__ == "other"


def test_python_file_plus_name(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(MODULE_TEXT)
    scorer = load_custom_scorer(str(path), "compute_score")
    assert scorer("d", "a", "a") == 1.0 and scorer("d", "a", "b") == 0.25
    assert load_custom_scorer(str(path), "other")("xy", "", "")["score"] == 7.0


def test_missing_module():
    with pytest.raises(ValueError) as caught:
        load_custom_scorer("ppoflow_no_such_module_xyz:compute_score", "compute_score")
    assert str(caught.value).startswith("cannot import 'ppoflow_no_such_module_xyz': ModuleNotFoundError: ")
    with pytest.raises(ValueError, match="^cannot import 'ppoflow_no_such_module_xyz'"):
        load_custom_scorer("ppoflow_no_such_module_xyz", "compute_score")
    with pytest.raises(ValueError, match="^cannot import '': ValueError: "):
        load_custom_scorer(":compute_score", "compute_score")


def test_missing_file(tmp_path):
    missing = str(tmp_path / "absent.py")
    with pytest.raises(ValueError) as caught:
        load_custom_scorer(missing, "compute_score")
    assert str(caught.value) == f"no such file {missing!r}"


def test_a_module_that_raises_while_imported_is_a_value_error(tmp_path, monkeypatch):
    (tmp_path / "ppoflow_broken_scorer.py").write_text(
        "import os\nraise RuntimeError('no API key in the environment')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as caught:
        load_custom_scorer("ppoflow_broken_scorer:compute_score", "compute_score")
    assert str(caught.value) == ("cannot import 'ppoflow_broken_scorer': RuntimeError: no API key in the environment")
    sys.modules.pop("ppoflow_broken_scorer", None)
    with pytest.raises(ValueError) as caught:
        load_custom_scorer(str(tmp_path / "ppoflow_broken_scorer.py"), "compute_score")
    assert str(caught.value) == (
        f"cannot import {str(tmp_path / 'ppoflow_broken_scorer.py')!r}: RuntimeError: no API key in the environment"
    )


def test_missing_or_uncallable_function(scorer_module, tmp_path):
    with pytest.raises(ValueError) as caught:
        load_custom_scorer(f"{scorer_module}:nope", "compute_score")
    assert str(caught.value) == f"'{scorer_module}:nope' has no callable 'nope'"
    with pytest.raises(ValueError) as caught:
        load_custom_scorer(scorer_module, "not_callable")
    assert str(caught.value) == f"'{scorer_module}' has no callable 'not_callable'"
    path = tmp_path / f"{scorer_module}.py"
    with pytest.raises(ValueError) as caught:
        load_custom_scorer(str(path), "absent")
    assert str(caught.value) == f"{str(path)!r} has no callable 'absent'"


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


def test_a_scorer_process_scores_as_the_scorer_does_in_process(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(MODULE_TEXT)
    sources, solutions, truths = ["ab", "abc", "ab"], ["x", "", "x"], ["x", "y", ["x", 1]]
    with ScorerProcess(str(path), "other", timeout_s=60) as scorer:
        assert score_responses(sources, solutions, truths, scorer) == score_responses(
            sources, solutions, truths, load_custom_scorer(str(path), "other")
        )
        with ScorerProcess(str(path), "compute_score", timeout_s=60) as other:
            assert score_responses(["d"], ["a"], ["a"], other) == ([1.0], {})
        child = scorer._sandbox.process.pid
        assert child != os.getpid() and scorer("d", "s", "t")["score"] == 7.0
        assert scorer._sandbox.process.pid == child  # one long-lived process for every call


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


@pytest.mark.reliability
def test_a_run_whose_scorer_exits_the_process_fails_naming_it(tmp_path, tiny_overrides):
    """The scorer passes the preflight and step 1, then ends its process while step 2 is scored: the run fails
    with a message naming the scorer, the prompt (uid ``2-*``: step 2) and its data source."""
    from ppoflow.configs import load_config
    from ppoflow.flows.train import train

    calls = tmp_path / "calls"
    (tmp_path / "my_reward.py").write_text(
        "import os\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a') as calls:\n"
        "        calls.write('.')\n"
        f"    if os.path.getsize({str(calls)!r}) > 1 + 16:  # the preflight's row, then step 1's 4 x 4 responses\n"
        "        os._exit(3)\n"
        "    return float(solution_str == ground_truth)\n"
    )
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [f"custom_reward_function.path={tmp_path}/my_reward.py", "trainer.test_freq=0", "trainer.save_freq=0"],
    )
    with pytest.raises(ScorerFailed) as caught:
        train(cfg, orchestrated=False)
    assert str(caught.value).startswith(
        f"the custom scorer '{tmp_path}/my_reward.py:compute_score' crashed: its "
        "process exited with code 3 while scoring a response to prompt '2-"
    )
    assert str(caught.value).endswith("(data source 'synthetic/copy')")


# ---------------------------------------------------------------------------- scorers that hang

HANGING_SCORER = """
import os
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(f"{__file__}.{solution_str}.pid", "w") as pid:
        pid.write(str(os.getpid()))
    if solution_str == "hang":
        time.sleep(10**9)
    return {"score": 1.0, "length": len(solution_str)}
"""


@pytest.fixture
def hanging_scorer(tmp_path):
    """A scorer file whose ``compute_score`` sleeps forever on the response ``hang``; each call writes its
    process id to ``<file>.<response>.pid``."""
    path = tmp_path / "slow_reward.py"
    path.write_text(HANGING_SCORER)
    return path


def hung_process_is_gone(scorer_file) -> bool:
    """Whether the process that scored the response ``hang`` is gone (not even a zombie is left)."""
    pid = int(Path(f"{scorer_file}.hang.pid").read_text())
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.reliability
def test_a_scorer_call_past_its_deadline_kills_the_process_and_fails_naming_the_sample(hanging_scorer):
    with ScorerProcess(str(hanging_scorer), "compute_score", timeout_s=1) as scorer:
        with pytest.raises(ScorerTimedOut) as caught:
            score_responses(["my/task"] * 2, ["ok", "hang"], ["t", "t"], scorer, prompt_ids=["4-0", "4-1"])
        assert str(caught.value) == (
            f"the custom scorer '{hanging_scorer}:compute_score' did not return within "
            "custom_reward_function.timeout_s=1 s (its process was killed) while scoring a "
            "response to prompt '4-1' (data source 'my/task')"
        )
        assert hung_process_is_gone(hanging_scorer)
        assert scorer("my/task", "ok", "t") == {"score": 1.0, "length": 2.0}  # a fresh process scores the next one


@pytest.mark.reliability
def test_on_timeout_score_gives_the_timeout_score_counts_it_and_reports_the_stall(hanging_scorer, caplog, monkeypatch):
    monkeypatch.setattr(bounded, "REPORT_EVERY_S", 0.2)  # report the stall within the 1 s deadline
    with (
        ScorerProcess(
            str(hanging_scorer), "compute_score", timeout_s=1, on_timeout="score", timeout_score=-0.5
        ) as scorer,
        caplog.at_level(logging.WARNING),
    ):
        scores, extras = score_responses(
            ["my/task"] * 3, ["ok", "hang", "fine"], ["t"] * 3, scorer, prompt_ids=["3-0", "3-1", "3-2"]
        )
        assert scores == [1.0, -0.5, 1.0]
        assert extras == {"length": [2.0, 4.0], "scorer_timeouts": [0.0, 1.0, 0.0]}
        assert hung_process_is_gone(hanging_scorer)
    sample = "a response to prompt '3-1' (data source 'my/task')"
    stalls = [record.getMessage() for record in caplog.records if "has been scoring" in record.getMessage()]
    assert stalls and all(
        re.fullmatch(
            rf"the custom scorer '{re.escape(str(hanging_scorer))}:compute_score' has been "
            rf"scoring {re.escape(sample)} for \d+ s \(custom_reward_function.timeout_s=1\)",
            message,
        )
        for message in stalls
    )
    assert (
        f"the custom scorer '{hanging_scorer}:compute_score' did not return within custom_reward_function."
        f"timeout_s=1 s (its process was killed) while scoring {sample}: it scores custom_reward_function."
        "timeout_score=-0.5 (on_timeout=score)"
    ) in caplog.messages


@pytest.mark.reliability
@pytest.mark.parametrize("on_timeout", ["fail", "score"])
def test_a_run_whose_scorer_hangs_fails_naming_it_or_scores_on(tmp_path, tiny_overrides, on_timeout):
    """The scorer passes the preflight, then sleeps forever on its next call, the first response of step 1: with
    ``on_timeout=fail`` the run fails naming the key, the prompt and its data source; with ``score`` both steps
    train and ``reward/scorer_timeouts`` counts the one timeout. The hung process is gone either way."""
    from ppoflow.configs import load_config
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import train

    calls = tmp_path / "calls"
    (tmp_path / "my_reward.py").write_text(
        "import os\n"
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a') as calls:\n"
        "        calls.write('.')\n"
        f"    if os.path.getsize({str(calls)!r}) == 2:  # the preflight's row, then the first response of step 1\n"
        "        open(__file__ + '.hang.pid', 'w').write(str(os.getpid()))\n"
        "        time.sleep(10**9)\n"
        "    return float(solution_str == ground_truth)\n"
    )
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [
            f"custom_reward_function.path={tmp_path}/my_reward.py",
            "custom_reward_function.timeout_s=1",
            f"custom_reward_function.on_timeout={on_timeout}",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
        ],
    )
    if on_timeout == "fail":
        with pytest.raises(ScorerTimedOut) as caught:
            train(cfg, orchestrated=False)
        assert str(caught.value) == (
            f"the custom scorer '{tmp_path}/my_reward.py:compute_score' did not return "
            "within custom_reward_function.timeout_s=1 s (its process was killed) while "
            "scoring a response to prompt '1-0' (data source 'synthetic/copy')"
        )
    else:
        train(cfg, orchestrated=False)
        rows = read_metrics(cfg.trainer.default_local_dir)
        assert [row["reward/scorer_timeouts"] for row in rows] == [1.0, 0.0]
    assert hung_process_is_gone(tmp_path / "my_reward.py")
