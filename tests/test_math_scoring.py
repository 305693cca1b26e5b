"""verl's math and QA scorers on real-looking answers - boxed, fractions, LaTeX, units, ``#### 1,234``, ``Answer:``
lines, ``<answer>`` tags - and, in a run, the math-verify ones in a scorer process whose deadline bounds a
pathological answer. The expected values are worked by hand from verl's rules (docstrings of
ppoflow.algorithms.math_scoring)."""

from __future__ import annotations

import pytest

from ppoflow.algorithms.math_scoring import (
    answers_match,
    gsm8k_score,
    last_boxed,
    math_dapo_score,
    math_score,
    math_verify_score,
    normalize_math_answer,
    normalize_qa_answer,
    qa_em_score,
)
from ppoflow.algorithms.scoring import score_responses
from ppoflow.workers.service.scorer_process import RunBuiltinScorers, ScorerProcess

# ---------------------------------------------------------------------------- reading the answer


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so $\\boxed{42}$.", "42"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("first \\boxed{1}, then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # the last box; escaped braces balance
        ("\\fbox{7}", "7"),
        ("the answer is $\\boxed 5$ indeed", "5"),  # verl's brace-less form, up to the closing $
        ("\\boxed{\\frac{1}{2}", None),  # never closed
        ("no boxed answer at all: 42", None),
        ("", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "answer, normalized",
    [
        ("$\\dfrac{1}{2}$", "\\frac{1}{2}"),
        ("x = \\left( 3, 4 \\right)", "(3,4)"),  # after the last =, no \left/\right, no spaces
        ("10 \\text{ cm}", "10cm"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("1,234", "1234"),
        ("1,234,567.5", "1234567.5"),
        ("(1,2)", "(1,2)"),  # a pair, not a thousands separator
        ("42.", "42"),
        ("\\textbf{Monday}", "Monday"),
    ],
)
def test_normalize_math_answer(answer, normalized):
    assert normalize_math_answer(answer) == normalized


@pytest.mark.parametrize(
    "answer, truth, same",
    [
        ("0.5", "\\frac{1}{2}", True),  # math-verify: numerically equal
        ("\\frac12", "0.5", True),
        ("\\sqrt{18}", "3\\sqrt{2}", True),
        ("(x+1)^2", "x^2+2x+1", True),
        ("10 \\text{ cm}", "10", True),  # units dropped
        ("\\dfrac{3}{4}", "0.75", True),
        ("-7.0", "-7", True),
        ("\\frac{\\pi}{2}", "\\pi/2", True),
        ("\\text{(B)}", "B", True),
        ("3", "2", False),
        ("\\frac{1}{3}", "0.3", False),
        ("x", "y", False),
        (None, "1", False),  # no answer found
    ],
)
def test_answers_match(answer, truth, same):
    assert answers_match(answer, truth) is same


# --------------------------------------------------------------------------------- the scorers


@pytest.mark.parametrize(
    "solution, truth, score",
    [
        ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72", 1.0),
        ("The total is 1,234 dollars.\n#### 1,234", "1234", 1.0),  # thousands commas ignored
        ("#### 1,234", "1,234", 1.0),
        ("so the answer is 72", "72", 0.0),  # strict: no #### marker
        ("#### 72.5", "72", 0.0),
    ],
)
def test_gsm8k(solution, truth, score):
    assert gsm8k_score("openai/gsm8k", solution, truth) == score


@pytest.mark.parametrize(
    "solution, truth, score",
    [
        ("The probability is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("So $x = \\boxed{0.5}$", "\\frac{1}{2}", 1.0),
        ("The side is $\\boxed{3\\sqrt{2}}$.", "\\sqrt{18}", 1.0),
        ("It is $\\boxed{10 \\text{ cm}}$ long.", "10", 1.0),
        ("$\\boxed{\\dfrac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
        ("First $\\boxed{2}$, no wait: $\\boxed{3}$", "3", 1.0),  # the last box counts
        ("First $\\boxed{2}$, no wait: $\\boxed{3}$", "2", 0.0),
        ("The answer is 0.5", "0.5", 0.0),  # no boxed answer at all
        ("$\\boxed{\\frac{1}{3}}$", "0.5", 0.0),
    ],
)
def test_math(solution, truth, score):
    result = math_score("lighteval/MATH", solution, truth)
    assert isinstance(result, float) and result == score


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("Let me compute.\nAnswer: 42", "42", {"score": 1.0, "acc": 1.0, "pred": "42"}),
        ("answer : $\\frac{1}{2}$", "0.5", {"score": 1.0, "acc": 1.0, "pred": "\\frac{1}{2}"}),
        ("Answer: 1,234", "1234", {"score": 1.0, "acc": 1.0, "pred": "1234"}),
        ("Answer: 41\nhmm, no.\nAnswer: 42", "42", {"score": 1.0, "acc": 1.0, "pred": "42"}),  # the last line
        ("Answer: 41", "42", {"score": -1.0, "acc": 0.0, "pred": "41"}),
        ("The answer is \\boxed{42}", "42", {"score": -1.0, "acc": 0.0, "pred": "[INVALID]"}),  # no Answer: line
        ("Answer: 42\n" + "x" * 300, "42", {"score": -1.0, "acc": 0.0, "pred": "[INVALID]"}),  # not in the last 300
    ],
)
def test_math_dapo(solution, truth, expected):
    assert math_dapo_score("aime2024", solution, truth) == expected


@pytest.mark.parametrize(
    "solution, truth, score",
    [
        ("Adding up, the sum is $\\boxed{\\frac{3}{4}}$.", "0.75", 1.0),
        ("So the area is $6\\sqrt{2}$", "\\sqrt{72}", 1.0),  # math-verify finds a $...$ answer without a box
        ("The final answer is 12", "12", 1.0),
        ("$\\boxed{13}$", "12", 0.0),
        ("I do not know.", "12", 0.0),
    ],
)
def test_math_verify(solution, truth, score):
    assert math_verify_score("numina_olympiads", solution, truth) == score


@pytest.mark.parametrize(
    "solution, truth, score",
    [
        ("<think>...</think><answer>The Eiffel Tower!</answer>", {"target": ["eiffel tower"]}, 1.0),
        ("<answer>an Apple</answer>", {"target": ["pear", "apple"]}, 1.0),  # articles, case; any target
        ("<answer>Paris, France.</answer>", "paris france", 1.0),  # punctuation; a plain ground truth
        ("<answer>Paris</answer>", ["London", "Rome"], 0.0),
        ("<answer>London</answer> no, <answer>Paris</answer>", {"target": ["Paris"]}, 1.0),  # the last one
        ("Paris", {"target": ["Paris"]}, 0.0),  # no answer tag
        ("<answer>x</answer>" * 10 + "<answer>Paris</answer>", {"target": ["Paris"]}, 0.25),  # 11 tags
    ],
)
def test_qa_exact_match(solution, truth, score):
    assert qa_em_score("searchR1_nq", solution, truth) == score


def test_normalize_qa_answer():
    assert normalize_qa_answer("  The  U.S.A.'s   Capital!") == "usas capital"


# ------------------------------------------------------------------------- in a run: a deadline


def test_a_run_scores_the_math_verify_scorers_in_a_scorer_process_as_in_this_one():
    scorers = RunBuiltinScorers(timeout_s=60, on_timeout="fail", timeout_score=0.0, error_score=0.0)
    process = scorers.scorer("aime2024")
    assert isinstance(process, ScorerProcess) and process.title == "the built-in scorer math_dapo_score"
    assert scorers.scorer("openai/gsm8k") is gsm8k_score  # a regex: stays in this process
    sources = ["aime2024", "lighteval/MATH", "numina_cn_k12", "openai/gsm8k"]
    solutions = ["Answer: 0.5", "$\\boxed{3\\sqrt{2}}$", "so $\\boxed{\\frac34}$", "#### 1,234"]
    truths = ["\\frac{1}{2}", "\\sqrt{18}", "0.75", "1234"]
    scores, extras = score_responses(sources, solutions, truths, scorers)
    assert scores == [1.0, 1.0, 1.0, 1.0]
    assert extras == {"acc": [1.0], "pred": ["0.5"], "scorer_errors": [0.0] * 4}


def test_a_pathological_answer_is_cut_off_at_the_deadline():
    """``9^{9^{9^9}}`` keeps sympy busy past math-verify's own 5 s: the scorer process's 2 s deadline ends it,
    and with on_timeout=score the response scores timeout_score, counted; the next response scores as usual."""
    scorers = RunBuiltinScorers(timeout_s=2, on_timeout="score", timeout_score=-2.0, error_score=0.0)
    warm = score_responses(["math_dapo"], ["Answer: 0.5"], ["\\frac12"], scorers)  # math-verify imported
    assert warm[0] == [1.0]
    sources = ["math_dapo"] * 2
    scores, extras = score_responses(sources, ["Answer: 9^{9^{9^{9}}}", "Answer: 0.25"], ["9", "\\frac14"], scorers)
    assert scores == [-2.0, 1.0]
    assert extras["scorer_timeouts"] == [1.0, 0.0] and extras["acc"] == [1.0]
