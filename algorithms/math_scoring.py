"""verl's math and QA scorers (``verl.utils.reward_score``), by the answer each one reads and how it compares.

Pure functions with verl's signature: the answer is the number after ``#### `` (GSM8K), the last ``\\boxed{}``
(MATH), the last ``Answer:`` line (DAPO, AIME), what math-verify extracts (Numina) or the last ``<answer>`` tag
(Search-R1 QA, exact match after SQuAD's normalisation). Two math answers are equal when their normalised texts
are, else when math-verify (sympy) finds them equivalent: ``\\frac{1}{2}`` and ``0.5``, ``10 \\text{ cm}`` and
``10``. sympy can run for ever on a pathological answer (``9^{9^{9^9}}``): math-verify's own timeouts work on a
main thread only, so a run calls the scorers of :data:`MATH_VERIFY_SCORERS` in a scorer process with a deadline
(:mod:`ppoflow.workers.service.scorer_process`). Details: docs/configuration.md#models-data-rewards-resources.
"""

from __future__ import annotations

import re
import string
import threading

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own limit on parsing or comparing one answer (its default), where it can keep it: on a main thread."""


# ------------------------------------------------------------------------------------------ answers


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces included; the
    rest of the line after ``\\boxed `` for the brace-less form; None when there is none or it is unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):
        return rest.strip().split("$")[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for index, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:index]
    return None


_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DROPPED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\$", "$", "^{\\circ}", "^\\circ", "\\%", "%")


def normalize_math_answer(answer: str) -> str:
    """A math answer as text to compare: what follows its last ``=``, without ``$``, spacing commands, ``\\left``/
    ``\\right``, degrees and percent signs, with ``\\text{...}`` unwrapped, ``\\dfrac``/``\\tfrac`` as ``\\frac``,
    no spaces, no thousands commas in a plain number and no final period."""
    text = str(answer).split("=")[-1]
    for dropped in _DROPPED:
        text = text.replace(dropped, "")
    text = _TEXT_COMMAND.sub(r"\1", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = "".join(text.split()).rstrip(".")
    return text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text) else text


def answers_match(answer: str | None, truth) -> bool:
    """Whether ``answer`` is ``truth``: the same normalised text, or equivalent to math-verify."""
    if answer is None:
        return False
    if normalize_math_answer(answer) == normalize_math_answer(truth):
        return True
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = _timeout_s()
    gold = parse(f"\\boxed{{{truth}}}", [LatexExtractionConfig()], parsing_timeout=timeout)
    found = parse(f"\\boxed{{{answer}}}", [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=timeout)
    return bool(gold and found and verify(gold, found, timeout_seconds=timeout))


def _timeout_s() -> int | None:
    """math-verify's timeouts (signal alarms) on a main thread; none elsewhere, where they raise instead."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


# ------------------------------------------------------------------------------------------ scorers

_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """GSM8K in verl's strict format: the number after the last ``#### `` must equal the ground truth."""
    found = _GSM8K_ANSWER.findall(solution_str)
    if not found:
        return 0.0
    return float(found[-1].replace(",", "").rstrip(".") == str(ground_truth).replace(",", ""))


def math_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """MATH (verl's ``math_reward``): 1 when the last ``\\boxed{}`` answer matches the ground truth, else 0."""
    return float(answers_match(last_boxed(solution_str), ground_truth))


_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def math_dapo_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """DAPO-Math and AIME (verl's ``math_dapo``): the last ``Answer: ...`` line in the last 300 characters;
    ``score`` 1 when it matches the ground truth, else -1, ``acc`` 1 or 0, ``pred`` the answer read (normalised;
    ``[INVALID]`` when there is none)."""
    found = _ANSWER_LINE.findall(solution_str[-300:])
    correct = bool(found) and answers_match(found[-1], ground_truth)
    pred = normalize_math_answer(found[-1]) if found else "[INVALID]"
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}


def math_verify_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Numina (verl's ``math_verify``): 1 when math-verify extracts from the response an answer equivalent to the
    ground truth (read as ``\\boxed{ground_truth}``), else 0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = _timeout_s()
    gold = parse(f"\\boxed{{{ground_truth}}}", [LatexExtractionConfig()], parsing_timeout=timeout)
    found = parse(solution_str, [ExprExtractionConfig(), LatexExtractionConfig()], parsing_timeout=timeout)
    return float(bool(gold and found and verify(gold, found, timeout_seconds=timeout)))


MATH_VERIFY_SCORERS = frozenset({math_score, math_dapo_score, math_verify_score})
"""The scorers that call math-verify: a run calls them in a scorer process with a deadline."""

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_qa_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", str(text).lower().translate(_PUNCTUATION)).split())


def qa_em_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """Search-R1 QA (verl's ``search_r1_like_qa_em``): 1 when the last ``<answer>...</answer>`` equals one of the
    ground truth's ``target`` answers (a mapping's, or the ground truth itself: a text or a list of texts) after
    :func:`normalize_qa_answer`, a quarter of that when the response has more than 10 answer tags, else 0."""
    found = _ANSWER_TAG.findall(solution_str)
    if not found:
        return 0.0
    targets = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    targets = [targets] if isinstance(targets, str) else list(targets)
    if normalize_qa_answer(found[-1].strip()) not in {normalize_qa_answer(target) for target in targets}:
        return 0.0
    return 0.25 if max(solution_str.count("<answer>"), solution_str.count("</answer>")) > 10 else 1.0
