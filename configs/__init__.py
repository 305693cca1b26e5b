"""Load a run configuration: defaults, a preset or YAML file, ``key=value`` overrides, validation.

``load_config("grpo_tiny", ["actor_rollout_ref.rollout.n=4"])`` merges ``ppo_trainer.yaml`` (the full
default), the preset (a name in this folder or a path to any YAML file) and Hydra-style dotlist
overrides with OmegaConf, resolves ``${...}`` interpolations, drops a preset's model or data recipe whose
path an override replaced (:data:`RECIPES`), and validates the result against :mod:`configs.schema` and
:mod:`configs.rules`. Every problem is collected into one :class:`ConfigError` whose lines name the
offending key and value, with the closest known key suggested for typos.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, get_args, get_origin

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from ppoflow.configs.rules import cross_field_errors
from ppoflow.configs.schema import PPOConfig, SkipStageConfig
from ppoflow.configs.stages import STAGES_WITH_SKIP
from ppoflow.storage.fs import normalize_url

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULTS_NAME = "ppo_trainer"
DEMO_NAME = "grpo_tiny"


class ConfigError(ValueError):
    """An invalid configuration; ``problems`` holds one ``(key, message)`` pair per problem."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  {key}: {message}" for key, message in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem{'s' * (len(problems) > 1)}):\n{lines}")


def tool_config_file(path: str) -> str:
    """``actor_rollout_ref.rollout.multi_turn.tool_config_path`` as a file to read: a bare name that is not
    a file here names one shipped in ``configs/tools/`` (``vault.yaml``), so a preset works from any
    directory; anything else is used as given."""
    shipped = CONFIG_DIR / "tools" / path
    if "/" not in path and not Path(path).exists() and shipped.is_file():
        return str(shipped)
    return path


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in ``configs/``."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def load_config(config: str | None = None, overrides: Sequence[str] = ()) -> PPOConfig:
    """Build and validate a run config from a preset name or YAML path plus ``key=value`` overrides."""
    defaults = _read_yaml(CONFIG_DIR / f"{DEFAULTS_NAME}.yaml")
    given = _parse_overrides(overrides)
    merged = OmegaConf.merge(defaults, _read_yaml(_preset_path(config or DEMO_NAME)), given)
    # Before resolving: an interpolation of a ``???`` key (critic.model.path) would otherwise fail
    # with "cannot resolve" and hide which key the user has to set.
    problems = [(key, f"is required; set it with {key}=...")
                for key in _missing_keys(OmegaConf.to_container(merged, resolve=False))]
    if problems:
        raise ConfigError(problems)
    try:
        container = OmegaConf.to_container(merged, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as error:
        raise ConfigError([(getattr(error, "full_key", None) or "?", f"cannot resolve: {error.msg}")]) from None
    _fill_skip_defaults(container, OmegaConf.to_container(defaults.skip.rollout))
    _unify_trainer_mode(container)
    _drop_recipes_of_replaced_paths(container, given, [word.partition("=")[0] for word in overrides])
    _make_paths_absolute(container)
    try:
        cfg = PPOConfig.model_validate(container)
    except ValidationError as error:
        raise ConfigError(validation_problems(error)) from None
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


def _read_yaml(path: Path) -> DictConfig:
    try:
        text = path.read_text()
        # OmegaConf.load takes a top-level string for more YAML ("words" -> {"words": None}): look first
        top = yaml.safe_load(text)
        if top is None or isinstance(top, dict):
            return OmegaConf.create(text)
    except Exception as error:  # yaml and OmegaConf raise many types; name the file
        raise ConfigError([(str(path), f"unreadable YAML: {error}")]) from None
    raise ConfigError([(str(path), "a config file holds a mapping of sections (data:, trainer:, ...) at its top "
                                   f"level, not a {type(top).__name__}")])


_YAML_11_BOOLEANS = {"yes", "no", "on", "off", "y", "n"}


def _parse_overrides(overrides: Sequence[str]):
    """Parse ``key=value`` words one by one, so that an error names the word that caused it.

    Values are YAML (``[1,2,3]``, ``null``, ``1e-3``), except that YAML 1.1's ``yes``/``no``/``on``/``off``
    stay strings: the strict schema then rejects them for a bool key instead of guessing.
    """
    parsed = []
    for word in overrides:
        key, separator, value = word.partition("=")
        if not separator or not key:
            raise ConfigError([(word, "an override must look like key=value (lists as key=[1,2,3])")])
        if value.strip().lower() in _YAML_11_BOOLEANS:
            word = f"{key}='{value}'"
        try:
            parsed.append(OmegaConf.from_dotlist([word]))
        except Exception as error:
            raise ConfigError([(key, f"cannot parse override {word!r}: {error}")]) from None
    return OmegaConf.merge(*parsed) if parsed else OmegaConf.create()


RECIPES = {"actor_rollout_ref.model.path": "actor_rollout_ref.model.build", "critic.model.path": "critic.model.build",
           "data.train_files": "data.synthetic", "data.val_files": "data.synthetic"}
"""Path keys and the recipe section that writes what they name when it is missing (a tiny model, synthetic
data). A recipe belongs to the paths it was written for: see :func:`_drop_recipes_of_replaced_paths`."""


def _drop_recipes_of_replaced_paths(container: dict, given, override_keys: Sequence[str]) -> None:
    """Null a preset's recipe when an override points its path elsewhere and overrides none of its keys.

    Without this, a typo in a real model path (or data file) silently trained a freshly built random
    model (or freshly generated synthetic data). An override of a recipe key (``...model.build.seed=1``,
    ``data.synthetic.train_rows=64``) asks for building or generating explicitly; a path overridden to
    null names nothing to build.
    """
    for path_key, recipe_key in RECIPES.items():
        if path_key not in override_keys or OmegaConf.select(given, path_key) is None:
            continue
        if any(key == recipe_key or key.startswith(f"{recipe_key}.") for key in override_keys):
            continue
        section, leaf = _parent(container, recipe_key)
        if section is not None:
            section[leaf] = None


PATH_KEYS = ("data.train_files", "data.val_files", "actor_rollout_ref.model.path",
             "actor_rollout_ref.model.tokenizer_path", "critic.model.path", "critic.model.tokenizer_path",
             "trainer.default_local_dir", "trainer.resume_from_path")
"""Keys holding local paths or URLs; relative local paths are resolved against the caller's working
directory here, once, so that Ray workers (which may run elsewhere) see the same files."""


def _make_paths_absolute(container: dict) -> None:
    keys = list(PATH_KEYS) + [f"skip.{stage}.dump_dir" for stage in (container.get("skip") or {})]
    for key in keys:
        node, leaf = _parent(container, key)
        if node is None or node.get(leaf) is None:
            continue
        value = node[leaf]
        if isinstance(value, str):
            node[leaf] = normalize_url(value)
        elif isinstance(value, list):
            node[leaf] = [normalize_url(v) if isinstance(v, str) else v for v in value]


def _parent(container: dict, key: str) -> tuple[dict | None, str]:
    """The mapping holding dotted ``key`` in ``container`` (None when a section on the way is not one), and
    the key's last part."""
    *parents, leaf = key.split(".")
    node = container
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def _unify_trainer_mode(container: dict) -> None:
    """``trainer.mode`` and verl's ``trainer.v1.trainer_mode`` are one setting: whichever is given sets both
    (neither: ``sync``); both given and different is a :class:`ConfigError` naming both."""
    trainer = container.get("trainer")
    if not isinstance(trainer, dict) or not isinstance(trainer.get("v1"), dict):
        return  # the schema reports the malformed section
    mode, v1_mode = trainer.get("mode"), trainer["v1"].get("trainer_mode")
    if mode is not None and v1_mode is not None and mode != v1_mode:
        raise ConfigError([("trainer.v1.trainer_mode", f"{v1_mode!r} disagrees with trainer.mode={mode!r}: they are "
                                                       "one setting; set one of them")])
    trainer["mode"] = trainer["v1"]["trainer_mode"] = mode or v1_mode or "sync"


def _fill_skip_defaults(container: dict, stage_defaults: dict) -> None:
    """Give every ``skip.<stage>`` section the defaults of ``skip.rollout`` in ``ppo_trainer.yaml``
    (verl's role defaults, the same for every stage) for the keys it does not set."""
    skip = container.get("skip")
    if isinstance(skip, dict):
        for stage, section in skip.items():
            if isinstance(section, dict):
                skip[stage] = {**stage_defaults, **section}


def _missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys still holding OmegaConf's ``???`` placeholder."""
    if isinstance(node, dict):
        return [key for name, value in node.items() for key in _missing_keys(value, f"{prefix}{name}.")]
    return [prefix[:-1]] if node == "???" else []


def validation_problems(error: ValidationError) -> list[tuple[str, str]]:
    """A schema's :class:`ValidationError` as ``(dotted key, message)`` pairs, for a :class:`ConfigError`."""
    return [_describe(issue) for issue in error.errors()]


_UNION_TAG = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\])")
"""How pydantic names the member of a ``Union`` in an error location (no config key is spelled so)."""


def _describe(issue: dict) -> tuple[str, str]:
    """Turn one pydantic error into ``(dotted key, message)``, suggesting a known key for typos."""
    if issue["loc"][:1] == ("skip",) and issue["loc"][2:3] == ("[key]",):
        stage = issue["input"]
        close = difflib.get_close_matches(stage, STAGES_WITH_SKIP, n=1)
        hint = f"; did you mean 'skip.{close[0]}'?" if close else f"; known: {', '.join(STAGES_WITH_SKIP)}"
        return f"skip.{stage}", f"unknown cache{hint}"
    loc = issue["loc"]
    if issue["type"] != "extra_forbidden":  # drop pydantic's union-member tags: data.train_files.str
        loc = [part for part in loc if not (isinstance(part, str) and _UNION_TAG.fullmatch(part))]
    key = ".".join(str(part) for part in loc)
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


def reference_table() -> str:
    """A markdown table of every config key: its type, its default in ``ppo_trainer.yaml``, its meaning."""
    defaults = OmegaConf.to_container(_read_yaml(CONFIG_DIR / f"{DEFAULTS_NAME}.yaml"), resolve=False)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str, default_node) -> None:
        for name, field in model.model_fields.items():
            key, default = f"{prefix}{name}", (default_node or {}).get(name) if isinstance(default_node, dict) else None
            if field.default is not PydanticUndefined and default is None:
                default = field.get_default(call_default_factory=True)
            section = _section_type(field.annotation)
            if section is not None and name != "skip":
                if field.description:  # an optional section: null, or a mapping of the keys below
                    rows.append(f"| `{key}` | null or section | `{json.dumps(default)}` | {field.description} |")
                walk(section, f"{key}.", default)
                continue
            if name == "skip":
                walk(SkipStageConfig, "skip.<stage>.", default.get("rollout") if isinstance(default, dict) else None)
                continue
            description = (field.description or "").replace("|", "\\|")
            rows.append(f"| `{key}` | {_type_name(field.annotation)} | `{json.dumps(default)}` | {description} |")

    walk(PPOConfig, "", defaults)
    return "\n".join(rows)


def _type_name(annotation) -> str:
    text = str(_without_constraints(annotation)).replace("typing.", "").replace("NoneType", "None")
    return text.replace("<class '", "").replace("'>", "").replace("|", "\\|")


def _without_constraints(annotation):
    """``list[Annotated[float, Field(ge=0, lt=1)]]`` -> ``list[float]``: the range is in the meaning column."""
    if get_origin(annotation) is Annotated:
        return _without_constraints(get_args(annotation)[0])
    if get_origin(annotation) is list:
        return list[_without_constraints(get_args(annotation)[0])]
    return annotation
