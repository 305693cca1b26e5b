"""Rule-based reward scorers, their choice by data_source (prefix families too), and custom scorers from config,
in process and in a scorer process, with each row's extra_info; rows whose reward_model.style is not rule. Scorers
that fail: tests/test_scoring_failures.py, that hang: tests/test_scoring_timeouts.py; the math and QA scorers:
tests/test_math_scoring.py."""

from __future__ import annotations

import os
import sys

import pytest

from ppoflow.algorithms.math_scoring import gsm8k_score, math_dapo_score, math_verify_score, qa_em_score
from ppoflow.algorithms.scoring import (
    BUILTIN_SCORERS,
    copy_score,
    load_custom_scorer,
    score_responses,
    scorer_for,
    vault_score,
)
from ppoflow.configs import ConfigError
from ppoflow.data.datasets import read_prompt_rows, write_rows
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
        "no reward scorer for data_source 'my/task'; built-ins: synthetic/copy, synthetic/vault, openai/gsm8k, "
        "lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, math_dapo, math, "
        "math_dapo_reasoning, aime*, numina_*, searchR1_* (a * ends a family of names); or set "
        "custom_reward_function.path"
    )
    assert scorer_for("synthetic/copy", None) is copy_score
    assert scorer_for("openai/gsm8k", None) is gsm8k_score
    custom = lambda *args, **kwargs: 0.0  # noqa: E731
    assert scorer_for("my/task", custom) is custom
    assert scorer_for("synthetic/copy", custom) is custom


@pytest.mark.parametrize(
    "source, scorer",
    [
        ("aime2024", math_dapo_score),  # verl: data_source.startswith("aime")
        ("aime", math_dapo_score),
        ("math", math_dapo_score),  # an exact name
        ("numina_olympiads", math_verify_score),
        ("numina_cn_k12", math_verify_score),
        ("searchR1_nq", qa_em_score),
        ("searchR1_hotpotqa", qa_em_score),
        ("openai/gsm8k", gsm8k_score),
    ],
)
def test_builtin_scorers_by_name_and_family(source, scorer):
    assert BUILTIN_SCORERS[source] is scorer and source in BUILTIN_SCORERS
    assert scorer_for(source, None) is scorer


@pytest.mark.parametrize("source", ["aim", "numina", "maths", "searchr1_nq", "openai/gsm8k2", "xaime2024", None])
def test_a_name_outside_every_family_has_no_builtin_scorer(source):
    assert source not in BUILTIN_SCORERS and BUILTIN_SCORERS.get(source) is None
    with pytest.raises(ValueError, match="^no reward scorer for data_source"):
        scorer_for(source, None)


# ------------------------------------------------------------------------------- extra_info

SEEING_SCORERS = """
def four(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float((extra_info or {}).get("index", -1)), "has_info": float(extra_info is not None)}

def three(data_source, solution_str, ground_truth):
    return float(solution_str == ground_truth)

def keywords(data_source, solution_str, ground_truth, **kwargs):
    return float(kwargs["extra_info"]["index"])
"""


def test_extra_info_reaches_scorers_of_either_signature_in_process_and_in_a_scorer_process(tmp_path):
    """verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)``; a scorer that takes only
    the first three (which verl also accepts) is called with those."""
    path = tmp_path / "seeing.py"
    path.write_text(SEEING_SCORERS)
    infos = [{"split": "train", "index": 3}, {"split": "train", "index": 5, "tools_kwargs": {"vault": {"key": "1"}}}]
    sources, solutions, truths = ["my/task"] * 2, ["12", "1"], ["12", "12"]
    expected = {
        "four": ([3.0, 5.0], {"has_info": [1.0, 1.0]}),
        "three": ([1.0, 0.0], {}),
        "keywords": ([3.0, 5.0], {}),
    }
    for name, result in expected.items():
        in_process = score_responses(sources, solutions, truths, load_custom_scorer(str(path), name), None, infos)
        with ScorerProcess(str(path), name, timeout_s=60) as scorer:
            assert score_responses(sources, solutions, truths, scorer, extra_infos=infos) == result == in_process
    missing = score_responses(["d"], ["x"], ["x"], load_custom_scorer(str(path), "four"))  # no extra_infos at all
    assert missing == ([-1.0], {"has_info": [0.0]})


def test_builtin_scorers_take_extra_info():
    info = {"split": "test", "index": 0}
    assert score_responses(
        ["synthetic/copy", "openai/gsm8k"], ["12", "#### 7"], ["12", "7"], None, None, [info] * 2
    ) == (
        [1.0, 1.0],
        {"exact": [1.0]},
    )


# -------------------------------------------------------------------------- reward_model.style


@pytest.mark.parametrize("style", ["rule", "model", None, "absent"])
def test_rule_rows_and_rows_without_a_style_read(tmp_path, style):
    reward_model = {"ground_truth": "12"} if style == "absent" else {"style": style, "ground_truth": "12"}
    write_rows(str(tmp_path / "rows.jsonl"), [{"data_source": "d", "prompt": "12>", "reward_model": reward_model}])
    rows = read_prompt_rows(str(tmp_path / "rows.jsonl"), _data(), key="data.train_files")
    assert rows[0]["reward_model"]["ground_truth"] == "12"


@pytest.mark.parametrize("style", ["rules", "reward"])
def test_a_row_whose_style_is_not_rule_is_refused_naming_it(tmp_path, style):
    rows = [
        {"data_source": "d", "prompt": "1>", "reward_model": {"style": "rule", "ground_truth": "1"}},
        {"data_source": "d", "prompt": "2>", "reward_model": {"style": style, "ground_truth": "2"}},
    ]
    write_rows(str(tmp_path / "rows.parquet"), rows)
    with pytest.raises(ConfigError) as caught:
        read_prompt_rows(str(tmp_path / "rows.parquet"), _data(), key="data.val_files")
    assert caught.value.problems == [
        (
            "data.val_files",
            f"row 1 reward_model.style is {style!r}, not verl's 'rule' or 'model' (the config's scorers and reward "
            "model score every row: docs/reward_models.md)",
        )
    ]


def _data():
    """The defaults' data section (only ``prompt_key`` matters to reading rows)."""
    from ppoflow.configs import load_config

    return load_config("grpo_tiny", ["data.train_files=unused.parquet"]).data


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
