"""Load a run configuration: defaults, a preset or YAML file, ``key=value`` overrides, validation.

``load_config("grpo_tiny", ["actor_rollout_ref.rollout.n=4"])`` merges ``ppo_trainer.yaml`` (the full
default), the preset (a name in this folder or a path to any YAML file) and Hydra-style dotlist
overrides with OmegaConf, resolves ``${...}`` interpolations, drops a preset's model or data recipe whose
path an override replaced (:data:`RECIPES`), and validates the result against :mod:`configs.schema` and
:mod:`configs.rules`. Every problem - unknown keys, bad values, the rules' - is collected into one
:class:`ConfigError` whose lines name the offending key and value; an unknown key of verl's gets its answer
by meaning (:mod:`configs.verl_keys`), a typo the closest known key.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from ppoflow.configs.normalize import normalize, parent_of
from ppoflow.configs.presets import CONFIG_DIR, DEFAULTS_NAME, preset_for, preset_path, read_yaml, without_hydra_prefix
from ppoflow.configs.problems import UNION_TAG, ConfigError, validation_problems
from ppoflow.configs.rules import cross_field_errors
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.verl_entries import hydra_preset


def tool_config_file(path: str) -> str:
    """``actor_rollout_ref.rollout.multi_turn.tool_config_path`` as a file to read: a bare name that is not
    a file here names one shipped in ``configs/tools/`` (``vault.yaml``), so a preset works from any
    directory; anything else is used as given."""
    shipped = CONFIG_DIR / "tools" / path
    if "/" not in path and not Path(path).exists() and shipped.is_file():
        return str(shipped)
    return path


def load_config(config: str | None = None, overrides: Sequence[str] = ()) -> PPOConfig:
    """Build and validate a run config from a preset name or YAML path plus ``key=value`` overrides.

    Every problem comes in one :class:`ConfigError`: unknown keys and bad values from the schema, and the
    cross-field rules' problems too, checked on a stand-in config when the schema fails (:func:`_stand_in`).
    """
    overrides = [without_hydra_prefix(word) for word in overrides]
    defaults = read_yaml(CONFIG_DIR / f"{DEFAULTS_NAME}.yaml")
    preset_file = preset_path(preset_for(config, overrides))
    preset = hydra_preset(read_yaml(preset_file), preset_file)
    given = _parse_overrides(overrides)
    merged = OmegaConf.merge(defaults, preset, given)
    # Before resolving: an interpolation of a ``???`` key (critic.model.path) would otherwise fail
    # with "cannot resolve" and hide which key the user has to set.
    problems = [
        (key, f"is required; set it with {key}=...")
        for key in _missing_keys(OmegaConf.to_container(merged, resolve=False))
    ]
    if problems:
        raise ConfigError(problems)
    try:
        container = OmegaConf.to_container(merged, resolve=True, throw_on_missing=False)
    except OmegaConfBaseException as error:
        raise ConfigError([(getattr(error, "full_key", None) or "?", f"cannot resolve: {error.msg}")]) from None
    skip_defaults = OmegaConf.to_container(defaults.skip.rollout)
    problems = normalize(container, skip_defaults)
    _drop_recipes_of_replaced_paths(container, given, [word.partition("=")[0] for word in overrides])
    try:
        cfg = PPOConfig.model_validate(container)
    except ValidationError as error:
        problems += validation_problems(error)
        # lazily: the defaults alone are resolved only when the preset's values do not make a valid stand-in
        fallbacks = (_fallback(*sources) for sources in ((defaults, preset), (defaults,)))
        cfg = _stand_in(container, error, (fallback for fallback in fallbacks if fallback is not None))
    if cfg is not None:
        problems += [problem for problem in cross_field_errors(cfg) if not _names_a_reported_key(problem, problems)]
    if problems:
        raise ConfigError(problems)
    return cfg


_FALLBACKS: dict[tuple, tuple[tuple[DictConfig, ...], dict | None]] = {}
"""The last few :func:`_fallback` results, by their sources' identities, the working and the home directory."""


def _fallback(*sources: DictConfig) -> dict | None:
    """The ``sources`` (the defaults, perhaps with the preset) merged, resolved and normalized as a config is,
    with null for their ``???`` keys: where a refused key takes its value from. None when they do not resolve (a
    broken preset). Every refused load needs one, so it is kept while :func:`read_yaml` returns the same sources
    (their files unchanged): read it, never modify it."""
    key = (*map(id, sources), os.getcwd(), os.environ.get("HOME"))
    held = _FALLBACKS.get(key)
    if held is None or any(kept is not source for kept, source in zip(held[0], sources, strict=True)):
        while len(_FALLBACKS) >= 8:
            _FALLBACKS.pop(next(iter(_FALLBACKS)))
        held = _FALLBACKS[key] = (sources, _resolved_fallback(sources))
    return held[1]


def _resolved_fallback(sources: tuple[DictConfig, ...]) -> dict | None:
    merged = OmegaConf.merge(*sources)
    for key in _missing_keys(OmegaConf.to_container(merged, resolve=False)):
        OmegaConf.update(merged, key, None)
    try:
        container = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException:
        return None
    normalize(container, OmegaConf.to_container(sources[0].skip.rollout))
    return container


def _stand_in(container: dict, error: ValidationError, fallbacks: Iterable[dict]) -> PPOConfig | None:
    """A valid config for the cross-field rules when the schema refused ``container``: every key it refused
    takes its value from the first fallback (the preset, then the defaults), or is dropped where the fallback
    has none (an unknown key, or one whose field default applies). None when no valid config comes of it."""
    stand_in = copy.deepcopy(container)
    for fallback in fallbacks:
        for issue in error.errors():
            _take_from(stand_in, fallback, _config_path(issue["loc"]))
        try:
            return PPOConfig.model_validate(stand_in)
        except ValidationError as still:
            error = still
    return None


def _config_path(loc: tuple) -> list[str]:
    """The config key a pydantic error location points into: its leading names, without list indexes,
    union-member tags or a mapping's ``[key]`` marker (``skip.rollout.steps.1`` -> skip, rollout, steps)."""
    path = []
    for part in loc:
        if not isinstance(part, str) or part == "[key]" or UNION_TAG.fullmatch(part):
            break
        path.append(part)
    return path


def _take_from(container: dict, fallback: dict, path: list[str]) -> None:
    """Set ``path`` in ``container`` to its value in ``fallback``, or delete it where ``fallback`` has none."""
    if not path:
        return
    node, source = container, fallback
    for name in path[:-1]:
        node, source = node.get(name), source.get(name) if isinstance(source, dict) else None
        if not isinstance(node, dict):
            return
    if isinstance(source, dict) and path[-1] in source:
        node[path[-1]] = copy.deepcopy(source[path[-1]])
    else:
        node.pop(path[-1], None)


def _names_a_reported_key(problem: tuple[str, str], reported: list[tuple[str, str]]) -> bool:
    """Whether a rule's problem is about a key already reported: the same key, a section holding it or a key
    in it, or the reported key named in its message (its value there is a stand-in's, not the user's)."""
    key, message = problem
    for other, _ in reported:
        if key == other or key.startswith(f"{other}.") or other.startswith(f"{key}."):
            return True
        if re.search(rf"(?<![\w.]){re.escape(other)}(?!\w)", message):
            return True
    return False


def config_as_dict(cfg: PPOConfig) -> dict:
    """The validated config as plain JSON-able data (for logs, summaries and fingerprints)."""
    return cfg.model_dump(mode="json")


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


RECIPES = {
    "actor_rollout_ref.model.path": "actor_rollout_ref.model.build",
    "critic.model.path": "critic.model.build",
    "data.train_files": "data.synthetic",
    "data.val_files": "data.synthetic",
}
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
        section, leaf = parent_of(container, recipe_key)
        if section is not None:
            section[leaf] = None


def _missing_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys still holding OmegaConf's ``???`` placeholder."""
    if isinstance(node, dict):
        return [key for name, value in node.items() for key in _missing_keys(value, f"{prefix}{name}.")]
    return [prefix[:-1]] if node == "???" else []
