"""The tool config file of agent loops: the specs it gives, and its errors naming the key, the file and the problem."""

from __future__ import annotations

import pytest
import yaml

from ppoflow.configs import ConfigError
from ppoflow.workers.service.tool_config import TOOL_CONFIG_KEY, load_tool_config
from tests.tools_helpers import TOOL_FUNCTIONS, TOOLS, tool


def test_specs_from_the_config_file(specs, tool_folder):
    lookup = next(spec for spec in specs if spec.name == "lookup")
    assert lookup.function == f"{tool_folder / 'tools.py'}:lookup"  # relative to the config file's folder
    assert (lookup.timeout_s, lookup.memory_mb, lookup.max_output_chars) == (2.0, 512, 256)
    hog = next(spec for spec in specs if spec.name == "hog")
    assert hog.memory_mb == 64
    schema = lookup.openai_schema()
    assert schema == TOOLS[1]["tool_schema"]
    schema["function"]["name"] = "changed"
    assert lookup.openai_schema()["function"]["name"] == "lookup"


GOOD = tool("tools.py:lookup", "lookup", {"key": {"type": "string"}}, ("key",))


def with_changes(entry: dict, **changes) -> dict:
    """A copy of a tool entry with top-level keys replaced (None removes one) or schema parts changed."""
    changed = yaml.safe_load(yaml.safe_dump(entry))
    for key, value in changes.items():
        if key == "schema_type":
            changed["tool_schema"]["type"] = value
        elif key == "key_type":
            changed["tool_schema"]["function"]["parameters"]["properties"]["key"]["type"] = value
        elif value is None:
            del changed[key]
        else:
            changed[key] = value
    return changed


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "no such tool config file: "),
        ("tools: [unclosed", " is not valid YAML: "),
        ("tool: []", ": must hold a mapping with a `tools:` list"),
        ({"tools": []}, ": `tools:` is empty"),
        ({"tools": [with_changes(GOOD, function=None)]}, ": tools[0] (lookup): `function` is missing"),
        ({"tools": [with_changes(GOOD, function="lookup")]}, ": tools[0] (lookup): function 'lookup' must look like"),
        (
            {"tools": [with_changes(GOOD, function="nowhere.py:f")]},
            ": tools[0] (lookup): function 'nowhere.py:f': no such",
        ),
        ({"tools": [with_changes(GOOD, tool_schema=None)]}, ": tools[0]: `tool_schema` is missing"),
        ({"tools": [GOOD, GOOD]}, ": tools[1] (lookup): duplicate tool name 'lookup'"),
        (
            {"tools": [with_changes(GOOD, schema_type="object")]},
            ": tools[0] (lookup): tool_schema.type must be 'function'",
        ),
        ({"tools": [with_changes(GOOD, config={"timeout": 1})]}, "unknown key 'timeout'; did you mean 'timeout_s'?"),
        (
            {"tools": [with_changes(GOOD, config={"memory_mb": 0.5})]},
            "config.memory_mb must be a positive whole number",
        ),
        (
            {"tools": [with_changes(GOOD, config={"timeout_s": float("inf")})]},
            "config.timeout_s must be a positive number",
        ),
        (
            {"tools": [with_changes(GOOD, key_type="str")]},
            "parameters.properties.key.type must be one of string, integer",
        ),
        ({"tools": [with_changes(GOOD, class_name="verl.tools.Lookup")]}, "class_name names a verl tool class"),
    ],
)
def test_config_errors_name_the_key_the_file_and_the_problem(tmp_path, content, problem):
    config = tmp_path / "tools.yaml"
    if content is not None:
        config.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    (tmp_path / "tools.py").write_text(TOOL_FUNCTIONS)
    with pytest.raises(ConfigError) as raised:
        load_tool_config(str(config))
    assert any(
        key == TOOL_CONFIG_KEY and str(config) in message and problem in message
        for key, message in raised.value.problems
    ), raised.value.problems


def test_config_errors_use_the_key_the_caller_names(tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_tool_config(str(tmp_path / "absent.yaml"), key="agent.tools")
    assert [key for key, _ in raised.value.problems] == ["agent.tools"]
