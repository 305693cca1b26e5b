"""Rule-based reward scorers, chosen per sample by its ``data_source``, and custom scorers from config.

A scorer has verl's signature ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
and returns a float, or a dict with a ``"score"`` float plus any extra numbers to log. ``solution_str``
is the decoded response up to (not including) its EOS token, with other special tokens kept, so a
policy cannot hide junk tokens from a rule checker. A scorer that raises or returns anything else is a
:class:`ScorerFailed` naming the scorer and the sample: user code fails the same way every time, so it is
never retried. A custom scorer call past ``custom_reward_function.timeout_s`` is a :class:`ScorerTimedOut`, or
(``on_timeout=score``) the response scores ``timeout_score``, flagged in the extra :data:`SCORER_TIMEOUTS`.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from contextvars import ContextVar

from ppoflow.algorithms.user_code import load_object

Scorer = Callable[..., "float | dict"]


def copy_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """The synthetic copy task: one point per correct leading character, one for stopping right.

    ``score = (sum_i [solution[i] == truth[i]] + [len(solution) == len(truth)]) / (len(truth) + 1)``;
    scoring the stop separately is what lets a from-scratch model learn to emit EOS.
    """
    matches = sum(a == b for a, b in zip(solution_str, ground_truth))
    stopped = len(solution_str) == len(ground_truth)
    return {"score": (matches + stopped) / (len(ground_truth) + 1), "exact": float(solution_str == ground_truth)}


def vault_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> dict:
    """The synthetic vault task: 1 when the final answer - the text after the last tool answer (``=code>``)
    when the trajectory called the tool, else the whole response - is the code, else 0. A code is right
    or wrong: no partial credit, so a model that cannot know the code gains nothing by guessing its shape."""
    exact = float(solution_str.rsplit(">", 1)[-1] == ground_truth)
    return {"score": exact, "exact": exact}


_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """GSM8K in verl's strict format: the number after ``#### `` must equal the ground truth."""
    found = _GSM8K_ANSWER.findall(solution_str)
    if not found:
        return 0.0
    return float(found[-1].replace(",", "").rstrip(".") == str(ground_truth).replace(",", ""))


BUILTIN_SCORERS: dict[str, Scorer] = {
    "synthetic/copy": copy_score,
    "synthetic/vault": vault_score,
    "openai/gsm8k": gsm8k_score,
}


class ScorerFailed(Exception):
    """A scorer could not score a response: it raised, returned something that is not a score, or (run in
    a process of its own) ended that process; the message names the scorer and what it was scoring."""


class ScorerTimedOut(ScorerFailed):
    """A custom scorer call ran past ``custom_reward_function.timeout_s`` (its process was killed)."""


SCORER_TIMEOUTS = "scorer_timeouts"
"""The extra a custom scorer with ``on_timeout=score`` reports for each response: 1 when it scored
``timeout_score`` because its call timed out, else 0 (summed per step as ``reward/scorer_timeouts``)."""

_SAMPLE: ContextVar[str] = ContextVar("ppoflow_scored_sample", default="a response")


def sample_being_scored() -> str:
    """The response :func:`score_one` is scoring now, as messages name it (for a scorer's own warnings)."""
    return _SAMPLE.get()


def load_custom_scorer(path: str, name: str) -> Scorer:
    """Import a scorer from ``module:function``, from ``module`` + ``name``, or from a ``.py`` file + ``name``.

    Any problem (no such file or module, a module that raises while it is imported, no such callable) is a
    ``ValueError`` whose message says what is wrong with ``path``; the caller names the config key.
    """
    scorer = load_object(path, name, kind="callable")
    if not callable(scorer):
        raise ValueError(f"{path!r} has no callable {name!r}")
    return scorer


def scorer_function(path: str, name: str) -> str:
    """``custom_reward_function.path`` and ``.name`` as one ``module:function`` or ``file.py:function``."""
    return path if ":" in path and not path.endswith(".py") else f"{path}:{name}"


def scorer_for(data_source: str, custom: Scorer | None) -> Scorer:
    """The custom scorer when configured, else the built-in one registered for ``data_source``."""
    if custom is not None:
        return custom
    if data_source not in BUILTIN_SCORERS:
        raise ValueError(
            f"no reward scorer for data_source {data_source!r}; built-ins: "
            f"{', '.join(BUILTIN_SCORERS)}; or set custom_reward_function.path"
        )
    return BUILTIN_SCORERS[data_source]


def solution_text(token_ids: list[int], tokenizer) -> str:
    """A response as a scorer sees it: its tokens up to (not including) a final EOS, decoded with other
    special tokens kept visible."""
    if token_ids and token_ids[-1] == tokenizer.eos_token_id:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def scorer_label(scorer: Scorer) -> str:
    """How messages name a scorer: ``the built-in scorer copy_score``, ``the custom scorer 'reward.py:f'``."""
    if scorer in BUILTIN_SCORERS.values():
        return f"the built-in scorer {scorer.__name__}"
    return f"the custom scorer {getattr(scorer, 'label', None) or repr(getattr(scorer, '__qualname__', scorer))}"


def as_score(result) -> tuple[float, dict[str, float]]:
    """A scorer's return value as ``(score, extras)``: a number, or a dict with a number under ``"score"``
    and numbers under any other keys; ``ValueError`` saying what it returned instead."""
    if isinstance(result, numbers.Real):
        return float(result), {}
    problem = _return_problem(result)
    if problem:
        raise ValueError(f"{problem}, not a number or a dict with a number under 'score'")
    return float(result["score"]), {str(key): float(value) for key, value in result.items() if key != "score"}


def _return_problem(result) -> str | None:
    """What is wrong with a return value that is not a number (None for a dict of numbers with a score)."""
    if not isinstance(result, dict):
        return f"returned {_shown(result)}"
    if "score" not in result:
        return f"returned a dict without 'score' (keys: {', '.join(map(repr, result)) or 'none'})"
    bad = [key for key, value in result.items() if not isinstance(value, numbers.Real)]
    return f"returned a dict whose {bad[0]!r} is {_shown(result[bad[0]])}" if bad else None


def _shown(value) -> str:
    if value is None:
        return "None"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def score_one(
    data_source: str, solution: str, ground_truth, custom: Scorer | None = None, *, sample: str
) -> tuple[float, dict[str, float]]:
    """One response's score and any extra values its scorer reported; :class:`ScorerFailed` (or a subclass)
    when the scorer raises, returns something else or times out, its message ending ``while scoring
    {sample}`` (``sample`` names the response, e.g. ``a response to prompt '3-1' (data source 'my/task')``)."""
    scorer = scorer_for(data_source, custom)
    token = _SAMPLE.set(sample)
    try:
        result = scorer(data_source, solution, ground_truth)
    except ScorerFailed as error:  # a scorer in a process of its own says itself what went wrong
        raise type(error)(f"{error} while scoring {sample}") from None
    except Exception as error:  # noqa: BLE001 - a scorer may raise anything
        raise ScorerFailed(
            f"{scorer_label(scorer)} raised {type(error).__name__}: {error} while scoring {sample}"
        ) from error
    finally:
        _SAMPLE.reset(token)
    try:
        return as_score(result)
    except ValueError as error:
        raise ScorerFailed(f"{scorer_label(scorer)} {error} while scoring {sample}") from None


def score_responses(
    data_sources: list[str],
    solutions: list[str],
    ground_truths: list,
    custom: Scorer | None = None,
    prompt_ids: list[str] | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Score each response; returns the scores and any extra per-sample values the scorers reported.
    A failure names the response (by its prompt's id in ``prompt_ids``, else its position) and its data source."""
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for index, (source, solution, truth) in enumerate(zip(data_sources, solutions, ground_truths, strict=True)):
        response = f"a response to prompt {prompt_ids[index]!r}" if prompt_ids else f"response {index}"
        score, extra = score_one(source, solution, truth, custom, sample=f"{response} (data source {source!r})")
        scores.append(score)
        for name, value in extra.items():
            extras.setdefault(name, []).append(value)
    return scores, extras
