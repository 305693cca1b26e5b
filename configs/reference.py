"""The key reference: every config key with its type, its default in ``ppo_trainer.yaml`` and its meaning
(``ppoflow config --reference``; docs/configuration.md holds a copy, kept in sync by a test)."""

from __future__ import annotations

import json
from typing import Annotated, get_args, get_origin

from omegaconf import OmegaConf
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from ppoflow.configs.presets import CONFIG_DIR, DEFAULTS_NAME, read_yaml
from ppoflow.configs.problems import section_type
from ppoflow.configs.schema import PPOConfig, SkipStageConfig


def reference_table() -> str:
    """A markdown table of every config key: its type, its default in ``ppo_trainer.yaml``, its meaning."""
    defaults = OmegaConf.to_container(read_yaml(CONFIG_DIR / f"{DEFAULTS_NAME}.yaml"), resolve=False)
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str, default_node) -> None:
        for name, field in model.model_fields.items():
            key, default = f"{prefix}{name}", (default_node or {}).get(name) if isinstance(default_node, dict) else None
            if field.default is not PydanticUndefined and default is None:
                default = field.get_default(call_default_factory=True)
            section = section_type(field.annotation)
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
