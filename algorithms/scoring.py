"""Rule-based reward scorers, chosen per sample by its ``data_source``, and custom scorers from config.

A scorer has verl's signature ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
and returns a float, or a dict with a ``"score"`` float plus any extra numbers to log. ``solution_str``
is the decoded response up to (not including) its EOS token, with other special tokens kept, so a
policy cannot hide junk tokens from a rule checker.
"""

from __future__ import annotations

import re
from collections.abc import Callable

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


def load_custom_scorer(path: str, name: str) -> Scorer:
    """Import a scorer from ``module:function``, from ``module`` + ``name``, or from a ``.py`` file + ``name``.

    Any problem (no such file or module, a module that raises while it is imported, no such callable) is a
    ``ValueError`` whose message says what is wrong with ``path``; the caller names the config key.
    """
    scorer = load_object(path, name, kind="callable")
    if not callable(scorer):
        raise ValueError(f"{path!r} has no callable {name!r}")
    return scorer


def scorer_for(data_source: str, custom: Scorer | None) -> Scorer:
    """The custom scorer when configured, else the built-in one registered for ``data_source``."""
    if custom is not None:
        return custom
    if data_source not in BUILTIN_SCORERS:
        raise ValueError(f"no reward scorer for data_source {data_source!r}; built-ins: "
                         f"{', '.join(BUILTIN_SCORERS)}; or set custom_reward_function.path")
    return BUILTIN_SCORERS[data_source]


def solution_text(token_ids: list[int], tokenizer) -> str:
    """A response as a scorer sees it: its tokens up to (not including) a final EOS, decoded with other
    special tokens kept visible."""
    if token_ids and token_ids[-1] == tokenizer.eos_token_id:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=False)


def score_one(data_source: str, solution: str, ground_truth, custom: Scorer | None = None
              ) -> tuple[float, dict[str, float]]:
    """One response's score and any extra values its scorer reported."""
    result = scorer_for(data_source, custom)(data_source, solution, ground_truth)
    if isinstance(result, dict):
        return float(result["score"]), {name: float(value) for name, value in result.items() if name != "score"}
    return float(result), {}


def score_responses(data_sources: list[str], solutions: list[str], ground_truths: list,
                    custom: Scorer | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Score each response; returns the scores and any extra per-sample values the scorers reported."""
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    for source, solution, truth in zip(data_sources, solutions, ground_truths, strict=True):
        score, extra = score_one(source, solution, truth, custom)
        scores.append(score)
        for name, value in extra.items():
            extras.setdefault(name, []).append(value)
    return scores, extras
