"""verl's command lines as they are: its entry points and Hydra's ``--config-path/--config-name`` on ``ppoflow train``.

``python3 -m verl.trainer.main_ppo`` is ``ppoflow train``; another of verl's entries (``--entry``) or one of verl's
own configs (``--config-name``) stands for a trainer mode (:data:`ENTRIES`, :data:`CONFIGS`); a Megatron config is
refused by name. A user's own Hydra YAML is read as verl reads it (:func:`hydra_preset`): its ``hydra:`` section is
Hydra's own, its ``defaults:`` list names the configs it builds on. The table: docs/configuration.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ppoflow.configs.presets import DEFAULTS_NAME, read_yaml
from ppoflow.configs.problems import ConfigError

ONE_STEP_OFF = ("trainer.mode=one_step_off",)
FULLY_ASYNC = ("trainer.mode=separate_async", "actor_rollout_ref.rollout.mode=async")

ENTRIES: dict[str, tuple[str, ...]] = {
    "verl.trainer.main_ppo": (),
    "recipe.dapo.main_dapo": (),
    "recipe.one_step_off_policy.main_ppo": ONE_STEP_OFF,
    "verl.experimental.one_step_off_policy.main_ppo": ONE_STEP_OFF,
    "recipe.fully_async_policy.fully_async_main": FULLY_ASYNC,
    "verl.experimental.fully_async_policy.fully_async_main": FULLY_ASYNC,
}
"""verl's entry module (``python3 -m ...``) -> the overrides it stands for here, over verl's defaults."""

CONFIGS: dict[str, tuple[str, ...]] = {
    "ppo_trainer": (),
    "dapo_trainer": (),
    "one_step_off_ppo_trainer": ONE_STEP_OFF,
    "fully_async_ppo_trainer": FULLY_ASYNC,
}
"""verl's own config names (``--config-name``, a ``defaults:`` entry) -> the overrides they stand for here, over
verl's defaults (configs/ppo_trainer.yaml); DAPO's keys come on its scripts' command lines."""

MEGATRON = "verl's Megatron config: not supported, the training engine is FSDP2 (strategy: fsdp2)"


def entry_overrides(entry: str) -> list[str]:
    """The overrides verl's entry module ``entry`` stands for; a ConfigError naming ``--entry`` for one unknown."""
    module = entry.removeprefix("python3 -m ").removeprefix("python -m ").strip()
    if module not in ENTRIES:
        known = ", ".join(ENTRIES)
        raise ConfigError([("--entry", f"{entry!r} is not one of verl's entry points that ppoflow runs ({known})")])
    return list(ENTRIES[module])


def hydra_config(config_path: str | None, config_name: str) -> tuple[str, list[str]]:
    """What ``--config-path/--config-name`` name: one of verl's own configs (its name in :data:`CONFIGS`, wherever
    the path points) as verl's defaults plus what it stands for; any other name, the YAML file it names under the
    path (read by :func:`hydra_preset`). A Megatron config, or a file that is not there, is a ConfigError."""
    name = config_name.removesuffix(".yaml").removesuffix(".yml")
    if "megatron" in name:
        raise ConfigError([("--config-name", f"{config_name}: {MEGATRON}")])
    if name in CONFIGS:
        return DEFAULTS_NAME, list(CONFIGS[name])
    path = Path(config_path or ".").expanduser() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            [("--config-name", f"no {path}: not one of verl's configs ({', '.join(CONFIGS)}) nor a file there")]
        )
    return str(path), []


def hydra_preset(preset: DictConfig, path: Path) -> DictConfig:
    """A YAML file as verl reads it: without its ``hydra:`` section, over the configs its ``defaults:`` list names -
    verl's own (:data:`CONFIGS`: what they stand for) or other files of its folder, read the same way - in the
    list's order, ``_self_`` (the file's own keys) last unless the list places it. A file without either is
    ``preset`` itself."""
    keys = set(preset.keys())
    if not keys & {"defaults", "hydra"}:
        return preset
    entries = preset.get("defaults", [])
    if not OmegaConf.is_list(entries):
        raise ConfigError([("--config", f"{path}: defaults: must be a list of config names")])
    entries = list(entries) + ([] if "_self_" in entries else ["_self_"])
    own = OmegaConf.create({key: preset[key] for key in keys - {"defaults", "hydra"}})
    return OmegaConf.merge(*(own if entry == "_self_" else _default_layer(entry, path) for entry in entries))


def _default_layer(entry, path: Path) -> DictConfig:
    """The config a ``defaults:`` entry of ``path`` names."""
    if not isinstance(entry, str):
        raise ConfigError([("--config", f"{path}: defaults entry {entry!r}: Hydra's config groups are not read here")])
    name = entry.removesuffix(".yaml")
    if "megatron" in name:
        raise ConfigError([("--config", f"{path}: defaults entry {entry!r}: {MEGATRON}")])
    if name in CONFIGS:
        return OmegaConf.from_dotlist(list(CONFIGS[name]))
    sibling = path.parent / f"{name}.yaml"
    if not sibling.is_file():
        raise ConfigError([("--config", f"{path}: defaults entry {entry!r}: no {sibling}, nor one of verl's configs")])
    return hydra_preset(read_yaml(sibling), sibling)


def verl_command(
    config: str | None, config_path: str | None, config_name: str | None, entry: str | None, overrides: Sequence[str]
) -> tuple[str | None, list[str], list[str]]:
    """A command line's preset and overrides once verl's ``--entry`` and ``--config-path/--config-name`` are read:
    ``(config, implied + overrides, implied)``, ``implied`` being what the entry or config stands for."""
    implied = entry_overrides(entry) if entry else []
    if config_name:
        if config:
            raise ConfigError([("--config-name", "give --config or verl's --config-name, not both")])
        config, named = hydra_config(config_path, config_name)
        implied += named
    elif config_path:
        raise ConfigError([("--config-path", "names the folder of --config-name, which is not given")])
    return config, [*implied, *overrides], implied
