"""Rule-based reward scorers, chosen per sample by its ``data_source``, and custom scorers from config.

A scorer has verl's signature ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (one
without ``extra_info`` is called with three) and returns a float, or a dict with a ``"score"`` float plus extra
numbers to log. ``solution_str`` is the decoded response up to (not including) its EOS token, other special tokens
kept, so a policy cannot hide junk tokens from a rule checker. A scorer that raises, returns anything else or a
non-finite number is a :class:`ScorerFailed` naming the scorer and the sample; a run's scorers score such a sample
``custom_reward_function.error_score`` instead (counted, :data:`SCORER_ERRORS`). A call past
``custom_reward_function.timeout_s`` is a :class:`ScorerTimedOut`, or (``on_timeout=score``) scores ``timeout_score``.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import Callable, Mapping
from contextvars import ContextVar

from ppoflow.algorithms.math_scoring import gsm8k_score, math_dapo_score, math_score, math_verify_score, qa_em_score
from ppoflow.algorithms.user_code import load_object

logger = logging.getLogger(__name__)

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


class ScorerTable(Mapping):
    """``data_source`` -> scorer, by name or by a family ``prefix*`` (verl's ``aime*``) that takes every name
    starting with the prefix: the exact name first, then the longest such prefix."""

    def __init__(self, scorers: dict[str, Scorer]):
        self._scorers = scorers

    def __getitem__(self, data_source: str) -> Scorer:
        if data_source in self._scorers:
            return self._scorers[data_source]
        families = [
            name
            for name in self._scorers
            if name.endswith("*") and isinstance(data_source, str) and data_source.startswith(name[:-1])
        ]
        if not families:
            raise KeyError(data_source)
        return self._scorers[max(families, key=len)]

    def __iter__(self):
        return iter(self._scorers)

    def __len__(self) -> int:
        return len(self._scorers)


BUILTIN_SCORERS = ScorerTable(
    {
        "synthetic/copy": copy_score,
        "synthetic/vault": vault_score,
        # verl's default_compute_score, by the data_source names its preprocessing scripts write
        "openai/gsm8k": gsm8k_score,
        "lighteval/MATH": math_score,
        "DigitalLearningGmbH/MATH-lighteval": math_score,
        "HuggingFaceH4/MATH-500": math_score,
        "math_dapo": math_dapo_score,
        "math": math_dapo_score,
        "math_dapo_reasoning": math_dapo_score,
        "aime*": math_dapo_score,
        "numina_*": math_verify_score,
        "searchR1_*": qa_em_score,
    }
)


class ScorerFailed(Exception):
    """A scorer could not score a response: it raised, returned something that is not a score, or (run in
    a process of its own) ended that process; the message names the scorer and what it was scoring."""


class ScorerTimedOut(ScorerFailed):
    """A scorer call in a process of its own ran past ``custom_reward_function.timeout_s`` (the process was killed)."""


class ScorerUnavailable(ScorerFailed):
    """A scorer process cannot start or cannot import its scorer: no sample's fault, so it always fails the stage."""


SCORER_TIMEOUTS = "scorer_timeouts"
"""The extra a custom scorer with ``on_timeout=score`` reports for each response: 1 when it scored
``timeout_score`` because its call timed out, else 0 (summed per step as ``reward/scorer_timeouts``)."""

SCORER_ERRORS = "scorer_errors"
"""The extra a run's scorers report for each response: 1 when it scored ``custom_reward_function.error_score``
because its scorer failed on it, else 0 (summed per step as ``reward/scorer_errors``)."""

PRED = "pred"
"""The one extra a scorer may report as text (verl's name): the answer it extracted from the response, which
validation's ``maj@n`` votes on (:mod:`ppoflow.algorithms.validation_metrics`); never averaged."""

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


class BuiltinScorers:
    """A run's scorer without ``custom_reward_function.path``: each response's built-in scorer, by its data source;
    a response its scorer fails on scores ``error_score`` (None: the failure is raised)."""

    def __init__(self, error_score: float | None = None):
        self.error_score = error_score

    def scorer(self, data_source: str) -> Scorer:
        """The scorer of ``data_source``'s responses (:func:`scorer_for`)."""
        return scorer_for(data_source, None)


def scorer_for(data_source: str, custom: Scorer | BuiltinScorers | None) -> Scorer:
    """The custom scorer when configured, else the built-in one registered for ``data_source``."""
    if isinstance(custom, BuiltinScorers):
        return custom.scorer(data_source)
    if custom is not None:
        return custom
    if data_source not in BUILTIN_SCORERS:
        raise ValueError(
            f"no reward scorer for data_source {data_source!r}; built-ins: "
            f"{', '.join(BUILTIN_SCORERS)} (a * ends a family of names); or set custom_reward_function.path"
        )
    return BUILTIN_SCORERS[data_source]


def has_scorer(data_source: str, custom: Scorer | BuiltinScorers | None) -> bool:
    """Whether a rule scores ``data_source``'s responses: a custom scorer scores every one, a built-in its own."""
    return (custom is not None and not isinstance(custom, BuiltinScorers)) or data_source in BUILTIN_SCORERS


def combined_scores(model_scores: list[float], rule_scores: dict[int, float], combine: str) -> list[float]:
    """Each response's reward when a model scores it too (``reward_model.combine``): ``sum`` adds its rule score
    (``rule_scores``, by row, for the rows whose data source has a scorer), ``rule_first`` keeps the rule score
    alone; a row without a rule score gets its model score either way."""
    return [
        model if row not in rule_scores else rule_scores[row] + (model if combine == "sum" else 0.0)
        for row, model in enumerate(model_scores)
    ]


def call_scorer(scorer: Scorer, data_source: str, solution_str: str, ground_truth, extra_info=None):
    """verl's call ``scorer(data_source, solution_str, ground_truth, extra_info)``: ``extra_info`` as the fourth
    argument, else as a keyword (``**kwargs``), else left out for a scorer that takes only the first three."""
    arguments = (data_source, solution_str, ground_truth)
    try:
        signature = inspect.signature(scorer)
    except (TypeError, ValueError):  # no signature to read (a C function): verl's call
        return scorer(*arguments, extra_info)
    for args, kwargs in (((*arguments, extra_info), {}), (arguments, {"extra_info": extra_info})):
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            continue
        return scorer(*args, **kwargs)
    return scorer(*arguments)


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
    return getattr(scorer, "title", None) or f"the custom scorer {getattr(scorer, '__qualname__', scorer)!r}"


def as_score(result) -> tuple[float, dict[str, float | str]]:
    """A scorer's return value as ``(score, extras)``: a number, or a dict with a number under ``"score"``
    and numbers under any other keys (or text under :data:`PRED`); ``ValueError`` saying what it returned instead."""
    if isinstance(result, numbers.Real):
        return float(result), {}
    problem = _return_problem(result)
    if problem:
        raise ValueError(f"{problem}, not a number or a dict with a number under 'score'")
    extras = {str(key): value if _is_pred(key, value) else float(value) for key, value in result.items()}
    return float(extras.pop("score")), extras


def _return_problem(result) -> str | None:
    """What is wrong with a return value that is not a number (None for a dict of numbers with a score)."""
    if not isinstance(result, dict):
        return f"returned {_shown(result)}"
    if "score" not in result:
        return f"returned a dict without 'score' (keys: {', '.join(map(repr, result)) or 'none'})"
    bad = [key for key, value in result.items() if not isinstance(value, numbers.Real) and not _is_pred(key, value)]
    return f"returned a dict whose {bad[0]!r} is {_shown(result[bad[0]])}" if bad else None


def _is_pred(key, value) -> bool:
    return key == PRED and isinstance(value, str)


def _shown(value) -> str:
    if value is None:
        return "None"
    text = repr(value)
    return f"a {type(value).__name__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def score_one(
    data_source: str,
    solution: str,
    ground_truth,
    custom: Scorer | BuiltinScorers | None = None,
    *,
    sample: str,
    extra_info=None,
    failures: dict[str, list[str]] | None = None,
) -> tuple[float, dict[str, float]]:
    """One response's score and any extra values its scorer reported. A failure (the scorer raises, returns
    something that is not a finite score, or ends its process) is a :class:`ScorerFailed` whose message ends
    ``while scoring {sample}`` (e.g. ``a response to prompt '3-1' (data source 'my/task')``) - unless ``custom``
    is a run's scorer with an ``error_score`` (:class:`BuiltinScorers`, a scorer process): then the response
    scores that, its failure goes into ``failures`` (message -> the samples) or, without it, to the log. Every
    score of a run's scorer carries :data:`SCORER_ERRORS`. A timeout and a scorer that cannot start always raise."""
    error_score = getattr(custom, "error_score", None)
    try:
        score, extras = _scored(
            data_source, solution, ground_truth, extra_info, scorer_for(data_source, custom), sample
        )
    except ScorerFailed as failure:
        if error_score is None or isinstance(failure, (ScorerTimedOut, ScorerUnavailable)):
            raise type(failure)(f"{failure} while scoring {sample}") from failure.__cause__
        if failures is None:
            _FAILURES_SEEN[str(failure)] += 1
            seen = _FAILURES_SEEN[str(failure)]
            if seen & (seen - 1) == 0:  # the 1st, 2nd, 4th, 8th ... time in this process: never a flood
                _log_failure(str(failure), [sample], error_score, seen=seen)
        else:
            failures.setdefault(str(failure), []).append(sample)
        return float(error_score), {SCORER_ERRORS: 1.0}
    return score, extras if error_score is None else {**extras, SCORER_ERRORS: 0.0}


_FAILURES_SEEN: Counter[str] = Counter()
"""How often each failure was scored ``error_score`` in this process, outside a batch (the rollout service)."""


def _scored(data_source: str, solution: str, ground_truth, extra_info, scorer: Scorer, sample: str):
    """``scorer``'s score and extras for one response; :class:`ScorerFailed` naming the scorer, not the sample."""
    token = _SAMPLE.set(sample)
    try:
        result = call_scorer(scorer, data_source, solution, ground_truth, extra_info)
    except ScorerFailed:  # a scorer in a process of its own says itself what went wrong
        raise
    except Exception as error:  # noqa: BLE001 - a scorer may raise anything
        raise ScorerFailed(f"{scorer_label(scorer)} raised {type(error).__name__}: {error}") from error
    finally:
        _SAMPLE.reset(token)
    try:
        score, extras = as_score(result)
    except ValueError as error:
        raise ScorerFailed(f"{scorer_label(scorer)} {error}") from None
    values = {"score": score, **extras}
    bad = next((name for name, value in values.items() if isinstance(value, float) and not math.isfinite(value)), None)
    if bad:
        raise ScorerFailed(f"{scorer_label(scorer)} returned {bad}={values[bad]}, not a finite number")
    return score, extras


def _log_failure(message: str, samples: list[str], error_score: float, *, seen: int | None = None) -> None:
    """One warning for a scorer failure: the first sample it hit, how many more, and the score they got."""
    others = len(samples) - 1
    more = f" and {others} more response{'s' if others > 1 else ''}" if others else ""
    times = f" (seen {seen} times in this process)" if seen and seen > 1 else ""
    logger.warning(
        "%s while scoring %s%s%s: scored custom_reward_function.error_score=%g",
        message,
        samples[0],
        more,
        times,
        error_score,
    )


def score_responses(
    data_sources: list[str],
    solutions: list[str],
    ground_truths: list,
    custom: Scorer | BuiltinScorers | None = None,
    prompt_ids: list[str] | None = None,
    extra_infos: list | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Score each response (:func:`score_one`, with its ``extra_infos`` entry); returns the scores and any extra
    per-sample values the scorers reported. A failure names the response (by its prompt's id in ``prompt_ids``,
    else its position) and its data source; failures scored ``error_score`` are logged once per distinct message."""
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    failures: dict[str, list[str]] = {}
    extra_infos = extra_infos if extra_infos is not None else [None] * len(solutions)
    rows = zip(data_sources, solutions, ground_truths, extra_infos, strict=True)
    for index, (source, solution, truth, extra_info) in enumerate(rows):
        response = f"a response to prompt {prompt_ids[index]!r}" if prompt_ids else f"response {index}"
        score, extra = score_one(
            source,
            solution,
            truth,
            custom,
            sample=f"{response} (data source {source!r})",
            extra_info=extra_info,
            failures=failures,
        )
        scores.append(score)
        for name, value in extra.items():
            extras.setdefault(name, []).append(value)
    for message, samples in failures.items():
        _log_failure(message, samples, custom.error_score)
    return scores, extras
