"""Load a run configuration: defaults, a preset or YAML file, ``key=value`` overrides, validation.

``load_config("grpo_tiny", ["actor_rollout_ref.rollout.n=4"])`` merges ``ppo_trainer.yaml`` (the full
default), the preset (a name in this folder or a path to any YAML file) and Hydra-style dotlist
overrides with OmegaConf, resolves ``${...}`` interpolations, and validates the result against
:mod:`configs.schema`. Every problem is collected into one :class:`ConfigError` whose lines name the
offending key and value, with the closest known key suggested for typos.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from configs.schema import STAGES_WITH_SKIP, PPOConfig, SkipStageConfig, cross_field_errors

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULTS_NAME = "ppo_trainer"
DEMO_NAME = "grpo_tiny"


class ConfigError(ValueError):
    """An invalid configuration; ``problems`` holds one ``(key, message)`` pair per problem."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  {key}: {message}" for key, message in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{lines}")


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in ``configs/``."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def load_config(config: str | None = None, overrides: Sequence[str] = ()) -> PPOConfig:
    """Build and validate a run config from a preset name or YAML path plus ``key=value`` overrides."""
    merged = OmegaConf.merge(_read_yaml(CONFIG_DIR / f"{DEFAULTS_NAME}.yaml"),
                             _read_yaml(_preset_path(config or DEMO_NAME)),
                             _parse_overrides(overrides))
    try:
        container = OmegaConf.to_container(merged, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as error:
        raise ConfigError([(getattr(error, "full_key", None) or "?", f"cannot resolve: {error.msg}")]) from None
    problems = [(key, f"is required; set it with {key}=...") for key in _missing_keys(container)]
    if problems:
        raise ConfigError(problems)
    try:
        cfg = PPOConfig.model_validate(container)
    except ValidationError as error:
        raise ConfigError([_describe(issue) for issue in error.errors()]) from None
    problems = cross_field_errors(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def config_as_dict(cfg: PPOConfig) -> dict:
    """The validated config as plain JSON-able data (for logs, summaries and fingerprints)."""
    return cfg.model_dump(mode="json")


def _preset_path(config: str) -> Path:
    if config.endswith((".yaml", ".yml")):
        path = Path(config).expanduser()
        if not path.is_file():
            raise ConfigError([("--config", f"no such file: {path}")])
        return path
    path = CONFIG_DIR / f"{config}.yaml"
    if not path.is_file():
        raise ConfigError([("--config", f"unknown preset {config!r}; presets: {', '.join(preset_names())} "
                                        "(or give a path ending in .yaml)")])
    return path


def _read_yaml(path: Path):
    try:
        return OmegaConf.load(path)
    except Exception as error:  # yaml and OmegaConf raise many types; name the file
        raise ConfigError([(str(path), f"unreadable YAML: {error}")]) from None


def _parse_overrides(overrides: Sequence[str]):
    for word in overrides:
        if "=" not in word or word.startswith("="):
            raise ConfigError([(word, "an override must look like key=value (lists as key=[1,2,3])")])
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except Exception as error:
        raise ConfigError([("overrides", f"cannot parse {list(overrides)}: {error}")]) from None


def _missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys still holding OmegaConf's ``???`` placeholder."""
    if isinstance(node, dict):
        return [key for name, value in node.items() for key in _missing_keys(value, f"{prefix}{name}.")]
    return [prefix[:-1]] if node == "???" else []


def _describe(issue: dict) -> tuple[str, str]:
    """Turn one pydantic error into ``(dotted key, message)``, suggesting a known key for typos."""
    if issue["loc"][:1] == ("skip",) and issue["loc"][2:3] == ("[key]",):
        stage = issue["input"]
        close = difflib.get_close_matches(stage, STAGES_WITH_SKIP, n=1)
        hint = f"; did you mean 'skip.{close[0]}'?" if close else f"; stages: {', '.join(STAGES_WITH_SKIP)}"
        return f"skip.{stage}", f"unknown stage{hint}"
    key = ".".join(str(part) for part in issue["loc"])
    if issue["type"] == "extra_forbidden":
        return key, f"unknown key{_suggestion(key)}"
    if issue["type"] == "missing":
        return key, "is required"
    return key, f"{issue['msg']} (got {issue['input']!r})"


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
        keys += _known_keys(_section_type(field.annotation), f"{prefix}{name}.") if _section_type(field.annotation) else []
    return keys


def _section_type(annotation) -> type[BaseModel] | None:
    """The config section class inside an annotation such as ``Optional[TinyModelConfig]``."""
    candidates = [annotation, *getattr(annotation, "__args__", ())]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
