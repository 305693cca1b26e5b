"""Shared by tests/test_tools*.py: the test tools (a module's text) and their config file's entries.
The ``tool_folder`` and ``specs`` fixtures (tests/conftest.py) write and load them."""

from __future__ import annotations

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
