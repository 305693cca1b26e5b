"""Declaring tools for multi-turn agent loops: the YAML file that names them, read into :class:`ToolSpec`.

:func:`load_tool_config` reads the file named by ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` (verl's
layout, except that a tool is a Python function, ``"pkg.module:fn"`` or ``"tools.py:fn"`` relative to the file,
with optional ``config`` limits and an OpenAI ``tool_schema``). It validates keys, schemas, limits and function
paths but never imports a tool's module: tool code runs only in the sandbox processes of
:class:`~ppoflow.workers.service.tools.ToolRunner`, whose :meth:`~ppoflow.workers.service.tools.ToolRunner.check`
reports functions that cannot be imported. The file format: docs/rollout_service.md#tools.
"""

from __future__ import annotations

import copy
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}
"""JSON Schema's basic types and the Python types ``json.loads`` gives for them (bool is only boolean)."""

_LIMIT_KEYS = ("timeout_s", "memory_mb", "max_output_chars")
"""The keys of a tool's ``config:`` section: the :class:`ToolSpec` fields of the same names."""

_TOOL_KEYS = ("function", "config", "tool_schema")
_TOOL_NAME_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
TOOL_NAME_MAX_LENGTH = 64
"""OpenAI's rule for function names: letters, digits, ``_`` and ``-``, at most 64 of them."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: its name, the function that implements it, its OpenAI schema and its limits.

    ``function`` is ``"package.module:function"`` or ``"/absolute/path/file.py:function"``; the function
    takes the call's arguments as keyword arguments and returns a ``str`` (or a JSON-serialisable value,
    which the model sees as JSON text). ``memory_mb`` is how much address space one call may add to its
    process; output beyond ``max_output_chars`` characters is cut off with a marker.
    Build specs with :func:`load_tool_config`, which validates them.
    """

    name: str
    function: str
    schema: dict = field(hash=False)
    timeout_s: float = 2.0
    memory_mb: int = 512
    max_output_chars: int = 256

    def openai_schema(self) -> dict:
        """The OpenAI function schema (``{"type": "function", "function": {...}}``) for chat templates that
        render tools; a copy, so that a caller cannot change the one calls are validated against."""
        return copy.deepcopy(self.schema)


def load_tool_config(path: str, key: str = TOOL_CONFIG_KEY) -> list[ToolSpec]:
    """Read and validate the tool config file at ``path`` (a local path or an fsspec URL).

    Every problem becomes one ``(key, message)`` line of a single ``ConfigError``; each message names the
    file and the tool (its index, and its name when it has one). No tool module is imported here (see
    :meth:`ppoflow.workers.service.tools.ToolRunner.check` for that); a relative ``.py`` path is resolved against the
    config file's folder.
    """
    # Imported here rather than at the top: every tool process imports this module (ppoflow.workers.service.tools
    # needs ToolSpec), and ppoflow.configs takes seconds and hundreds of MB to import, which every process
    # start (and restart) would pay.
    from ppoflow.configs import ConfigError
    from ppoflow.storage.fs import normalize_url, open_fs

    url = normalize_url(path)
    try:
        fs, fs_path = open_fs(url)
        text = fs.cat_file(fs_path).decode()
    except FileNotFoundError:
        raise ConfigError([(key, f"no such tool config file: {url}")]) from None
    except (OSError, ValueError) as error:
        raise ConfigError([(key, f"cannot read tool config file {url}: {error}")]) from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError([(key, f"tool config file {url} is not valid YAML: {error}")]) from None
    local_folder = None if "://" in url else Path(url).parent
    specs, problems = _tool_specs(document, local_folder)
    if problems:
        raise ConfigError([(key, f"tool config file {url}: {problem}") for problem in problems])
    return specs


def _tool_specs(document, local_folder: Path | None) -> tuple[list[ToolSpec], list[str]]:
    """The specs a parsed tool config declares, and its problems (``local_folder``: where relative ``.py``
    paths point, None for a remote config)."""
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        return [], ["must hold a mapping with a `tools:` list (verl's tool config layout)"]
    problems = [f"unknown top-level key {name!r}; the only one is `tools`" for name in document if name != "tools"]
    if not document["tools"]:
        problems.append("`tools:` is empty; declare at least one tool or unset the key")
    specs: list[ToolSpec] = []
    names_seen: set[str] = set()
    for index, entry in enumerate(document["tools"]):
        spec, tool_problems = _tool_spec(entry, local_folder)
        label = f"tools[{index}]" + (f" ({spec.name})" if spec else "")
        problems += [f"{label}: {problem}" for problem in tool_problems]
        if spec is None:
            continue
        if spec.name in names_seen:
            problems.append(f"{label}: duplicate tool name {spec.name!r}; tool names must be unique")
        names_seen.add(spec.name)
        specs.append(spec)
    return specs, problems


def _tool_spec(entry, local_folder: Path | None) -> tuple[ToolSpec | None, list[str]]:
    """One ``tools:`` entry as a spec (None when it has no usable name) and the entry's problems."""
    if not isinstance(entry, dict):
        return None, [f"must be a mapping with function and tool_schema, not {type(entry).__name__}"]
    problems = [
        "class_name names a verl tool class; ppoflow tools are functions: set `function`"
        if name == "class_name"
        else _unknown_key_problem(name, _TOOL_KEYS)
        for name in entry
        if name not in _TOOL_KEYS
    ]
    function, function_problems = _function_path(entry.get("function"), local_folder)
    schema = entry.get("tool_schema")
    name, schema_problems = _schema_problems(schema)
    limits, limit_problems = _limits(entry.get("config"))
    problems += function_problems + schema_problems + limit_problems
    if name is None:
        return None, problems
    return ToolSpec(name=name, function=function or "", schema=schema, **limits), problems


def _unknown_key_problem(name, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
    return f"unknown key {name!r}; {hint}"


def _function_path(value, local_folder: Path | None) -> tuple[str | None, list[str]]:
    """``value`` checked (not imported) and normalised: ``module:function``, or ``file.py:function`` with the
    file made absolute and required to exist."""
    if value is None:
        return None, ["`function` is missing; set it to 'package.module:function' or 'file.py:function'"]
    source, _, attribute = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not source or not attribute.isidentifier():
        return None, [f"function {value!r} must look like 'package.module:function' or 'file.py:function'"]
    if not source.endswith(".py"):
        if not all(part.isidentifier() for part in source.split(".")):
            return None, [f"function {value!r}: {source!r} is not a module name (or a path ending in .py)"]
        return value, []
    file = Path(source).expanduser()
    if not file.is_absolute():
        if local_folder is None:
            return None, [
                (f"function {value!r}: a relative .py path needs a local tool config file; give an absolute path")
            ]
        file = local_folder / file
    if not file.is_file():
        return None, [f"function {value!r}: no such file {str(file)!r}"]
    return f"{file.resolve()}:{attribute}", []


def _schema_problems(schema) -> tuple[str | None, list[str]]:
    """The tool's name from its ``tool_schema`` (None when it has none) and what is wrong with the schema."""
    if schema is None:
        return None, ["`tool_schema` is missing; give the tool's OpenAI function schema"]
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict):
        return None, ["tool_schema must be a mapping with type: function and a function: mapping"]
    problems = (
        [] if schema.get("type") == "function" else [f"tool_schema.type must be 'function', not {schema.get('type')!r}"]
    )
    function = schema["function"]
    name = function.get("name")
    if (
        not isinstance(name, str)
        or not name
        or len(name) > TOOL_NAME_MAX_LENGTH
        or not set(name) <= _TOOL_NAME_CHARACTERS
    ):
        problems.append(
            f"tool_schema.function.name must be 1 to {TOOL_NAME_MAX_LENGTH} letters, digits, _ or -, not {name!r}"
        )
        name = None
    if not isinstance(function.get("description", ""), str):
        problems.append("tool_schema.function.description must be a string")
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        return name, problems + ["tool_schema.function.parameters must be a mapping with type: object"]
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict):
        return name, problems + ["tool_schema.function.parameters.properties must be a mapping"]
    for argument, declared in properties.items():
        where = f"tool_schema.function.parameters.properties.{argument}"
        if not isinstance(declared, dict):
            problems.append(f"{where} must be a mapping (type:, description:, ...)")
            continue
        types = declared.get("type", [])
        if not isinstance(types, list):
            types = [types]
        unknown = [kind for kind in types if not isinstance(kind, str) or kind not in JSON_TYPES]
        if unknown or ("type" in declared and not types):
            problems.append(
                f"{where}.type must be one of {', '.join(JSON_TYPES)} (or a list of them), not {declared['type']!r}"
            )
        if "enum" in declared and not isinstance(declared["enum"], list):
            problems.append(f"{where}.enum must be a list")
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(
        isinstance(argument, str) and argument in properties for argument in required
    ):
        problems.append(f"tool_schema.function.parameters.required must list names of properties, not {required!r}")
    return name, problems


def _limits(config) -> tuple[dict, list[str]]:
    """The limits a tool's ``config:`` section sets (the others keep :class:`ToolSpec`'s defaults)."""
    if config is None:
        return {}, []
    if not isinstance(config, dict):
        return {}, [f"config must be a mapping of {', '.join(_LIMIT_KEYS)}, not {type(config).__name__}"]
    problems = [f"config: {_unknown_key_problem(name, _LIMIT_KEYS)}" for name in config if name not in _LIMIT_KEYS]
    limits = {}
    for name in _LIMIT_KEYS:
        if name not in config:
            continue
        value = config[name]
        allowed = (int, float) if name == "timeout_s" else (int,)
        if isinstance(value, bool) or not isinstance(value, allowed) or not 0 < value < math.inf:
            kind = "number" if name == "timeout_s" else "whole number"
            problems.append(f"config.{name} must be a positive {kind}, not {value!r}")
        else:
            limits[name] = float(value) if name == "timeout_s" else value
    return limits, problems
