"""The run configuration: :func:`load_config` and the rest of the loader (:mod:`configs.loader`), the problems a
config can have (:mod:`configs.problems`), the key reference (:mod:`configs.reference`). The schema
(:mod:`configs.schema`), the rules that relate keys (:mod:`configs.rules`) and what each trainer mode needs
(:mod:`configs.modes`) have modules of their own.
"""

from ppoflow.configs.loader import config_as_dict, load_config, tool_config_file
from ppoflow.configs.presets import CONFIG_DIR, DEFAULTS_NAME, DEMO_NAME, preset_for, preset_line, preset_names
from ppoflow.configs.problems import ConfigError, validation_problems
from ppoflow.configs.reference import reference_table

__all__ = [
    "CONFIG_DIR",
    "DEFAULTS_NAME",
    "DEMO_NAME",
    "ConfigError",
    "config_as_dict",
    "load_config",
    "preset_for",
    "preset_line",
    "preset_names",
    "reference_table",
    "tool_config_file",
    "validation_problems",
]
