"""Tools for agent loops: calls run in sandbox processes that fail safely, tool modules imported only there,
and tool processes that end with their runner and the trainer. The config file: tests/test_tools_config.py."""

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

from ppoflow.workers.service.tool_config import ToolSpec, load_tool_config
from ppoflow.workers.service.tools import ToolRunner
from tests.tools_helpers import TOOL_FUNCTIONS, tool


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
