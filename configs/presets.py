"""The YAML files a config is built from: verl's defaults (:data:`DEFAULTS_NAME`), the presets beside them (the demo,
:data:`DEMO_NAME`, among them) or a file of the user's, each parsed once while it is unchanged (:func:`read_yaml`),
and which preset a command line gets when it names none (:func:`preset_for`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

from ppoflow.configs.problems import ConfigError
from ppoflow.storage.fs import path_problem

CONFIG_DIR = Path(__file__).resolve().parent
DEFAULTS_NAME = "ppo_trainer"
DEMO_NAME = "grpo_tiny"


def preset_names() -> list[str]:
    """Names of the YAML presets shipped in ``configs/``."""
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


MODEL_PATH_KEY = "actor_rollout_ref.model.path"


def preset_for(config: str | None, overrides: Sequence[str]) -> str:
    """The preset a run's overrides are merged over: ``config`` when one is named; else verl's defaults alone
    (:data:`DEFAULTS_NAME`) for a command line that names its own model - a verl script's, which must get verl's
    defaults for every key it leaves out, never the demo's - and the demo (:data:`DEMO_NAME`) for one that does
    not (``ppoflow train`` alone)."""
    if config:
        return config
    keys = {without_hydra_prefix(word).partition("=")[0] for word in overrides}
    return DEFAULTS_NAME if MODEL_PATH_KEY in keys else DEMO_NAME


def preset_line(config: str | None, overrides: Sequence[str]) -> str:
    """What a run says first: the preset its overrides apply to (:func:`preset_for`)."""
    name, count = preset_for(config, overrides), len(overrides)
    given = f"{count} override{'s' if count != 1 else ''}"
    if name == DEFAULTS_NAME:
        return f"config: verl's defaults (configs/{DEFAULTS_NAME}.yaml) and {given}"
    demo = f" (the demo; a command line that sets {MODEL_PATH_KEY} gets verl's defaults)" if name == DEMO_NAME else ""
    return f"config: the {name} preset{demo} and {given}"


def preset_path(config: str) -> Path:
    if config.endswith((".yaml", ".yml")):
        path = Path(config).expanduser()
        problem = path_problem(str(path))  # a FIFO, a symlink loop, a dangling link: not "no such file"
        if problem is not None:
            raise ConfigError([("--config", f"{path} {problem}")])
        if not path.is_file():
            raise ConfigError([("--config", f"no such file: {path}")])
        return path
    path = CONFIG_DIR / f"{config}.yaml"
    if not path.is_file():
        raise ConfigError(
            [
                (
                    "--config",
                    f"unknown preset {config!r}; presets: {', '.join(preset_names())} (or give a path ending in .yaml)",
                )
            ]
        )
    return path


def read_yaml(path: Path) -> DictConfig:
    """The YAML mapping in ``path``, shared between calls while the file is unchanged (every load reads the
    defaults, and parsing them is most of a load's time): read it, never modify it."""
    try:
        stat = path.stat()
    except OSError as error:
        raise ConfigError([(str(path), f"unreadable YAML: {error}")]) from None
    # resolved: a relative path read from another directory is another file
    return _parsed_yaml(path, path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _parsed_yaml(path: Path, resolved: Path, mtime_ns: int, size: int) -> DictConfig:
    try:
        text = path.read_text()
        # OmegaConf.load takes a top-level string for more YAML ("words" -> {"words": None}): look first
        top = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if top is None or isinstance(top, dict):
            return OmegaConf.create(text)
    except Exception as error:  # yaml and OmegaConf raise many types; name the file
        raise ConfigError([(str(path), f"unreadable YAML: {error}")]) from None
    raise ConfigError(
        [
            (
                str(path),
                "a config file holds a mapping of sections (data:, trainer:, ...) at its top "
                f"level, not a {type(top).__name__}",
            )
        ]
    )


def without_hydra_prefix(word: str) -> str:
    """A verl command line's ``+key=value`` (Hydra: add a key) or ``++key=value`` (add or set) as ``key=value``:
    every key has a default here, so both just set it."""
    return word[2:] if word.startswith("++") else word[1:] if word.startswith("+") else word
