"""Tools for agent loops: the tool config file, and calls run in sandbox processes that fail safely."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from ppoflow.configs import ConfigError
from ppoflow.workers.service.tool_config import TOOL_CONFIG_KEY, ToolSpec, load_tool_config
from ppoflow.workers.service.tools import ToolRunner

TOOL_FUNCTIONS = """
import os
import time


def pid():
    return os.getpid()


def lookup(key, count=1):
    return {"key": key, "count": count}


async def shout(text):
    return text.upper()


def fail(message):
    raise ValueError(message)


def leave():
    raise SystemExit(5)


def give_set():
    return {1, 2}


def give_object():
    return object()


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


def hog():
    blocks = []
    for _ in range(64):  # 1 GiB in all, far beyond its limit
        blocks.append(bytearray(16 << 20))
    return len(blocks)


def exit_3():
    os._exit(3)


def segfault():
    import ctypes
    ctypes.string_at(0)


def long_text():
    return "y" * 1000
"""


def tool(function: str, name: str, properties: dict | None = None, required: tuple = (), **config) -> dict:
    """One entry of a tool config file."""
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": f"the {name} test tool",
            "parameters": {"type": "object", "properties": properties or {}, "required": list(required)},
        },
    }
    return {"function": function, "tool_schema": schema, **({"config": config} if config else {})}


TOOLS = [
    tool("tools.py:pid", "pid"),
    tool("tools.py:lookup", "lookup", {"key": {"type": "string"}, "count": {"type": "integer"}}, ("key",)),
    tool("tools.py:shout", "shout", {"text": {"type": "string"}}, ("text",)),
    tool("tools.py:fail", "fail", {"message": {"type": "string"}}, ("message",), max_output_chars=80),
    tool("tools.py:leave", "leave"),
    tool("tools.py:give_set", "give_set"),
    tool("tools.py:give_object", "give_object"),
    tool("tools.py:sleep_then_pid", "sleep_then_pid", {"seconds": {"type": "number"}}, ("seconds",), timeout_s=1.0),
    tool("tools.py:hog", "hog", memory_mb=64),
    tool("tools.py:exit_3", "exit_3"),
    tool("tools.py:segfault", "segfault"),
    tool("tools.py:long_text", "long_text", max_output_chars=100),
    tool("tools.py:no_such_function", "missing_function"),
    tool("no_such_module_for_tools:run", "missing_module"),
]


@pytest.fixture(scope="module")
def tool_folder(tmp_path_factory) -> Path:
    """A folder with the test tools (tools.py) and their config (tools.yaml)."""
    folder = tmp_path_factory.mktemp("tools")
    (folder / "tools.py").write_text(TOOL_FUNCTIONS)
    (folder / "tools.yaml").write_text(yaml.safe_dump({"tools": TOOLS}))
    return folder


@pytest.fixture(scope="module")
def specs(tool_folder) -> list[ToolSpec]:
    return load_tool_config(str(tool_folder / "tools.yaml"))


@pytest.fixture(scope="module")
def runner(specs):
    """One runner for the tests that only call tools: each failing call must leave it working for the next."""
    with ToolRunner(specs, processes=2) as shared:
        yield shared


def works(runner: ToolRunner) -> bool:
    """The runner still answers a good call, from a process that is not this one."""
    result = runner.call_sync("pid", {})
    return result.ok and int(result.text) != os.getpid()


def exited(pid: int) -> bool:
    """The process has exited and been reaped (an orphan's zombie counts as exited: its new parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --------------------------------------------------------------------------------- good calls


def test_a_call_runs_in_another_process(runner):
    result = runner.call_sync("pid", {})
    assert result.ok and result.error is None and result.seconds > 0
    assert int(result.text) != os.getpid()


@pytest.mark.parametrize("arguments", [{"key": "k", "count": 2}, '{"key": "k", "count": 2}'])
def test_arguments_as_a_mapping_or_json_text_and_a_json_result(runner, arguments):
    result = runner.call_sync("lookup", arguments)
    assert result.ok and result.text == '{"key": "k", "count": 2}'


def test_arguments_the_row_fixes_win_over_the_models(runner):
    result = runner.call_sync("lookup", {"key": "model's", "count": 2}, fixed={"key": "row's"})
    assert result.ok and result.text == '{"key": "row\'s", "count": 2}'
    assert runner.call_sync("lookup", {"count": "x"}, fixed={"key": "k"}).error == "bad_arguments"  # still checked


def test_an_async_tool_is_awaited(runner):
    assert runner.call_sync("shout", {"text": "hi"}).text == "HI"


def test_concurrent_calls_use_every_process_and_no_more(runner):
    runner.check()  # both processes started and ready, so that only the calls are timed
    started = time.monotonic()

    async def four_calls():
        return await asyncio.gather(*(runner.call("sleep_then_pid", {"seconds": 0.4}) for _ in range(4)))

    results = asyncio.run(four_calls())
    elapsed = time.monotonic() - started
    assert all(result.ok for result in results)
    assert len({result.text for result in results}) == 2  # two processes, two calls each
    assert 0.75 < elapsed < 1.5  # two at a time: two rounds of 0.4 s, not one, not four


def test_output_beyond_the_limit_is_truncated_with_a_marker(runner):
    result = runner.call_sync("long_text", {})
    assert result.ok
    assert result.text == "y" * 100 + "... [truncated: 1000 characters in all]"


# ---------------------------------------------------------------------- failures as observations


def test_a_raising_tool_gives_the_exception_type_and_a_truncated_message(runner):
    result = runner.call_sync("fail", {"message": "no such key " + "x" * 500})
    assert not result.ok and result.error == "raised"
    assert result.text.startswith("error: fail raised ValueError: no such key xxx")
    assert result.text.endswith("characters in all]") and len(result.text) < 150
    assert works(runner)


def test_system_exit_in_a_tool_is_an_observation_not_an_exit(runner):
    result = runner.call_sync("leave", {})
    assert (result.error, result.text) == ("raised", "error: leave raised SystemExit: 5")
    assert works(runner)


@pytest.mark.parametrize("name, returned", [("give_set", "a set"), ("give_object", "a object")])
def test_a_result_that_is_not_text_or_json(runner, name, returned):
    result = runner.call_sync(name, {})
    assert result.error == "bad_return"
    assert result.text == f"error: {name} returned {returned}, which is neither text nor JSON-serialisable"


def test_a_call_past_its_timeout_is_killed_and_the_next_call_works(runner):
    started = time.monotonic()
    result = runner.call_sync("sleep_then_pid", {"seconds": 60})
    assert time.monotonic() - started < 1.0 + 1.5
    assert (result.error, result.text) == ("timeout", "error: sleep_then_pid timed out after 1 s")
    assert works(runner) and runner.call_sync("sleep_then_pid", {"seconds": 0}).ok


def test_a_memory_hog_hits_its_limit_and_the_runner_keeps_working(runner):
    result = runner.call_sync("hog", {})
    assert (result.error, result.text) == ("memory", "error: hog ran out of memory (it may use 64 MB per call)")
    assert works(runner)


@pytest.mark.parametrize(
    "name, ending", [("exit_3", "exited with code 3"), ("segfault", "was killed by signal SIGSEGV")]
)
def test_a_tool_that_kills_its_process_gives_an_error_and_a_fresh_process(runner, name, ending):
    result = runner.call_sync(name, {})
    assert (result.error, result.text) == ("crashed", f"error: {name} crashed: its process {ending}")
    assert works(runner)


@pytest.mark.parametrize(
    "name, arguments, kind, message",
    [
        ("lookup", {"count": 1}, "bad_arguments", "bad arguments for lookup: missing required argument 'key'"),
        ("lookup", {"key": 3}, "bad_arguments", "bad arguments for lookup: argument 'key' must be string, not integer"),
        (
            "lookup",
            {"key": "k", "count": True},
            "bad_arguments",
            "bad arguments for lookup: argument 'count' must be integer, not boolean",
        ),
        ("lookup", '{"key": "k"', "bad_arguments", "bad arguments for lookup: arguments are not valid JSON"),
        ("lookup", '["k"]', "bad_arguments", "bad arguments for lookup: arguments must be a JSON object, not array"),
        ("lookup", {"key": {1, 2}}, "bad_arguments", "bad arguments for lookup: arguments are not JSON-serialisable"),
        ("search", {}, "unknown_tool", "unknown tool 'search'; the tools are: pid, lookup, shout"),
        ("s" * 1000, {}, "unknown_tool", "unknown tool '" + "s" * 64 + "... [truncated: 1000 characters in all]'"),
    ],
)
def test_calls_that_cannot_run_are_refused_without_a_process(runner, name, arguments, kind, message):
    result = runner.call_sync(name, arguments)
    assert result.error == kind and not result.ok
    assert result.text.startswith(f"error: {message}")


def test_stats_count_calls_and_errors_by_kind(runner):
    before = runner.stats()
    runner.call_sync("pid", {})
    runner.call_sync("fail", {"message": "m"})
    runner.call_sync("search", {})
    after = runner.stats()
    assert after["calls"] - before["calls"] == 3
    assert after["errors"] - before["errors"] == 2
    assert after["errors/raised"] - before["errors/raised"] == 1
    assert after["errors/unknown_tool"] - before["errors/unknown_tool"] == 1
    assert after["mean_seconds"] > 0


# ------------------------------------------------------------------- imports: only in the sandbox


def test_check_reports_the_tools_that_cannot_be_imported(runner, tool_folder):
    problems = runner.check()
    assert len(problems) == 2
    missing_function, missing_module = problems
    assert missing_function.startswith(f"tool 'missing_function' ({tool_folder / 'tools.py'}:no_such_function): ")
    assert "has no callable 'no_such_function'" in missing_function
    assert missing_module.startswith("tool 'missing_module' (no_such_module_for_tools:run): cannot import")
    assert "ModuleNotFoundError" in missing_module
    result = runner.call_sync("missing_module", {})
    assert result.error == "unavailable" and result.text.startswith("error: tool missing_module is unavailable: ")
    assert works(runner)


def test_a_process_that_cannot_start_is_reported_by_check(tool_folder):
    (tool_folder / "exits_on_import.py").write_text("import os\nos._exit(7)\n")
    spec = ToolSpec(
        name="broken",
        function=f"{tool_folder / 'exits_on_import.py'}:run",
        schema={"type": "function", "function": {"name": "broken"}},
    )
    with ToolRunner([spec]) as broken:
        assert broken.check() == [
            "tools broken: the tool process exited with code 7 while importing the tool functions"
        ]
        result = broken.call_sync("broken", {})
        assert result.error == "start_failed" and "exited with code 7" in result.text


@pytest.mark.reliability
def test_check_reports_a_schema_that_does_not_match_the_function(tool_folder):
    (tool_folder / "mismatched.py").write_text(
        "def by_name(key, count=1):\n    return key\n\n"
        "def by_position(key, /):\n    return key\n\n"
        "def anything(**kwargs):\n    return kwargs\n"
    )
    properties = {"key": {"type": "string"}, "limit": {"type": "integer"}}
    schema = {"type": "object", "properties": properties}
    specs = [
        ToolSpec(
            name=name,
            function=f"{tool_folder / 'mismatched.py'}:{name}",
            schema={"type": "function", "function": {"name": name, "parameters": schema}},
        )
        for name in ("by_name", "by_position", "anything")
    ]
    with ToolRunner(specs) as runner:
        assert runner.check() == [
            f"tool 'by_name' ({tool_folder / 'mismatched.py'}:by_name): its tool_schema declares 'limit', which "
            "by_name(key, count=1) does not take",
            f"tool 'by_position' ({tool_folder / 'mismatched.py'}:by_position): by_position(key, /) takes 'key' by "
            "position only; tools are called with keywords",
        ]
        assert runner.call_sync("anything", {"key": "a", "limit": 2}).text == '{"key": "a", "limit": 2}'
        assert runner.call_sync("by_name", {"key": "a"}).error == "unavailable"


def test_the_caller_never_imports_a_tool_module(tmp_path, monkeypatch):
    module_name = "ppoflow_test_tool_module"
    (tmp_path / f"{module_name}.py").write_text(TOOL_FUNCTIONS)
    (tmp_path / "file_tools.py").write_text(TOOL_FUNCTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))  # where the tool processes (which copy sys.path) find the module
    config = tmp_path / "tools.yaml"
    config.write_text(
        yaml.safe_dump({"tools": [tool(f"{module_name}:pid", "by_module"), tool("file_tools.py:pid", "by_file")]})
    )
    with ToolRunner(load_tool_config(str(config))) as isolated:
        assert isolated.check() == []
        assert all(int(isolated.call_sync(name, {}).text) != os.getpid() for name in ("by_module", "by_file"))
    assert module_name not in sys.modules
    assert not [
        module
        for module in list(sys.modules.values())
        if getattr(module, "__file__", None) == str(tmp_path / "file_tools.py")
    ]


# ------------------------------------------------------------------------------ process cleanup


def test_close_kills_and_reaps_every_process(specs):
    runner = ToolRunner(specs, processes=2)
    runner.check()

    async def two_pids():
        return await asyncio.gather(*(runner.call("sleep_then_pid", {"seconds": 0.2}) for _ in range(2)))

    pids = {int(result.text) for result in asyncio.run(two_pids())}
    assert len(pids) == 2
    runner.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # not even a zombie: close() reaped it
            os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="closed"):
        runner.call_sync("pid", {})


SCRIPT = """
import os, signal, sys, threading, time
from ppoflow.workers.service.tool_config import ToolSpec
from ppoflow.workers.service.tools import ToolRunner

if __name__ == "__main__":
    schema = {"type": "function", "function": {"name": "sleep_then_pid"}}
    runner = ToolRunner([ToolSpec(name="sleep_then_pid", function=sys.argv[1], schema=schema, timeout_s=120)])
    print(runner.call_sync("sleep_then_pid", {"seconds": 0}).text, flush=True)
    if sys.argv[2] == "killed":  # killed while a tool runs: the tool process must not outlive it
        threading.Thread(target=runner.call_sync, args=("sleep_then_pid", {"seconds": 60})).start()
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("ending", ["exits", "killed"])
def test_tool_processes_end_with_the_trainer(tool_folder, ending):
    script = tool_folder / "trainer.py"
    script.write_text(textwrap.dedent(SCRIPT))
    # Only stdout is a pipe, read up to the first line: a tool process that outlived the script would hold
    # the pipe open, and waiting for its end would wait for the tool.
    with subprocess.Popen(
        [sys.executable, str(script), f"{tool_folder / 'tools.py'}:sleep_then_pid", ending],
        stdout=subprocess.PIPE,
        text=True,
    ) as trainer:
        tool_pid = int(trainer.stdout.readline())
        trainer.wait(timeout=30)
    assert wait_until(lambda: exited(tool_pid))


# ----------------------------------------------------------------------------- the config file


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
