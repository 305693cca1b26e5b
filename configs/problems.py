"""A config's problems as ``(key, message)`` pairs: :class:`ConfigError`, and the schema's validation errors
told by key - an unknown key of verl's answered by meaning (:mod:`configs.verl_keys`), a typo with the closest
known key."""

from __future__ import annotations

import difflib
import re

from pydantic import BaseModel, ValidationError

from ppoflow.configs.schema import PATH_NAME_PATTERN, PATH_NAME_RULE, PPOConfig, SkipStageConfig
from ppoflow.configs.stages import STAGES_WITH_SKIP
from ppoflow.configs.verl_answers import verl_answer


class ConfigError(ValueError):
    """An invalid configuration; ``problems`` holds one ``(key, message)`` pair per problem."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  {key}: {message}" for key, message in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{lines}")


def validation_problems(error: ValidationError) -> list[tuple[str, str]]:
    """A schema's :class:`ValidationError` as ``(dotted key, message)`` pairs, for a :class:`ConfigError`."""
    return [problem for issue in error.errors() for problem in _describe(issue)]


UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")
"""How pydantic names the member of a ``Union`` in an error location (no config key is spelled so)."""


def _describe(issue: dict) -> list[tuple[str, str]]:
    """Turn one pydantic error into ``(dotted key, message)`` pairs (an unknown section may hold several
    of verl's keys), suggesting a known key for typos."""
    if issue["loc"][:1] == ("skip",) and issue["loc"][2:3] == ("[key]",):
        stage = issue["input"]
        close = difflib.get_close_matches(stage, STAGES_WITH_SKIP, n=1)
        hint = f"; did you mean 'skip.{close[0]}'?" if close else f"; known: {', '.join(STAGES_WITH_SKIP)}"
        return [(f"skip.{stage}", f"unknown cache{hint}")]
    loc = issue["loc"]
    if issue["type"] != "extra_forbidden":  # drop pydantic's union-member tags: data.train_files.str
        loc = [part for part in loc if not (isinstance(part, str) and UNION_TAG.fullmatch(part))]
    key = ".".join(str(part) for part in loc)
    if issue["type"] == "extra_forbidden":
        return _unknown_key_problems(key, issue["input"])
    if issue["type"] == "missing":
        return [(key, "is required")]
    if issue["type"] == "string_pattern_mismatch" and issue["ctx"]["pattern"] == PATH_NAME_PATTERN:
        return [(key, f"must be one directory name: {PATH_NAME_RULE} (got {issue['input']!r})")]
    return [(key, f"{issue['msg']} (got {issue['input']!r})")]


def _unknown_key_problems(key: str, value) -> list[tuple[str, str]]:
    """An unknown ``key`` (holding ``value``): verl's keys in it get the answer of :mod:`configs.verl_keys`
    (by meaning), and what is left the closest known key (by spelling)."""
    answers, unanswered = {}, False
    for leaf in _leaf_keys(key, value):
        answer = verl_answer(leaf, within=key)
        if answer is None:
            unanswered = True
        else:
            answers[answer[0]] = f"unknown key; {answer[1]}"
    return list(answers.items()) + ([(key, f"unknown key{_suggestion(key)}")] if unanswered else [])


def _leaf_keys(key: str, value) -> list[str]:
    """The dotted keys of the values under ``key`` (``key`` itself when it holds a plain value)."""
    if isinstance(value, dict) and value:
        return [leaf for name, inner in value.items() for leaf in _leaf_keys(f"{key}.{name}", inner)]
    return [key]


def _suggestion(key: str) -> str:
    known = _known_keys(PPOConfig)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [candidate for candidate in known if candidate.rsplit(".", 1)[-1] == leaf]
    close = difflib.get_close_matches(key, same_leaf or known, n=1, cutoff=0.0 if same_leaf else 0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        if name == "skip" and model is PPOConfig:
            keys += [f"skip.{stage}.{leaf}" for stage in STAGES_WITH_SKIP for leaf in SkipStageConfig.model_fields]
            continue
        keys.append(prefix + name)
        keys += (
            _known_keys(section_type(field.annotation), f"{prefix}{name}.") if section_type(field.annotation) else []
        )
    return keys


def section_type(annotation) -> type[BaseModel] | None:
    """The config section class inside an annotation such as ``Optional[TinyModelConfig]``."""
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
