"""Running tools for multi-turn agent loops: each call in a sandbox process, bounded in time and memory.

:class:`ToolRunner` runs the calls of :mod:`ppoflow.workers.service.agent_loop` in sandbox processes
(:mod:`ppoflow.workers.service.sandbox`; the caller may be a multi-threaded Ray actor) that import the tool
functions once and run every call under resource limits; whatever goes wrong becomes an error observation for the
model, never an exception or a hang in the trainer, and a process that timed out or died is replaced. Every tool
process imports this module, so it imports nothing heavy at module level.
How a tool process is confined: docs/rollout_service.md#tools.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import queue
import resource
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ppoflow.workers.service.sandbox import (
    ProcessEnded,
    Sandbox,
    SandboxFailed,
    cpu_budget_s,
    describe_error,
    kill_sandboxes,
    set_soft_limit,
)
from ppoflow.workers.service.tool_config import JSON_TYPES, TOOL_NAME_MAX_LENGTH, ToolSpec

logger = logging.getLogger(__name__)

ERROR_KINDS = (
    "unknown_tool",
    "bad_arguments",
    "unavailable",
    "raised",
    "bad_return",
    "memory",
    "timeout",
    "crashed",
    "start_failed",
)
"""The values of :attr:`ToolResult.error`: what went wrong, in one word, for logs and metrics."""

# ------------------------------------------------------------------------------ in the trainer


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: ``text`` is what the model sees (the result, or an ``error: ...``
    observation); ``error`` is None on success, else one of :data:`ERROR_KINDS`; ``seconds`` is how long
    the call took for the caller, waiting for a free tool process included."""

    text: str
    ok: bool
    error: str | None
    seconds: float


class _BadArguments(ValueError):
    """The arguments of a call do not fit the tool's schema; the message says how."""


class ToolRunner:
    """Runs tool calls in ``processes`` sandbox processes, never in the caller's.

    Calls beyond ``processes`` at once wait for a free process. ``start_timeout_s`` bounds how long a
    process may take to start and import the tool functions. Use :meth:`check` before training to fail
    fast on tools that cannot be imported; :meth:`close` (or ``with``) ends the processes, and so does the
    interpreter's exit.
    """

    def __init__(self, specs: list[ToolSpec], *, processes: int = 1, start_timeout_s: float = 30.0):
        if processes < 1:
            raise ValueError(f"processes must be at least 1, not {processes}")
        self.specs = {spec.name: spec for spec in specs}
        if len(self.specs) != len(specs):
            raise ValueError("tool names must be unique")
        self.processes = processes
        self.start_timeout_s = start_timeout_s
        self._functions = {spec.name: spec.function for spec in specs}
        self._parameters = {
            spec.name: list(spec.schema["function"].get("parameters", {}).get("properties", {})) for spec in specs
        }
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.SimpleQueue[Sandbox | None] = queue.SimpleQueue()
        for _ in range(processes):
            self._idle.put(None)  # a process starts when a call (or check) first needs it
        self._executor = ThreadPoolExecutor(max_workers=processes, thread_name_prefix="ppoflow-tools")
        self._lock = threading.Lock()
        self._closed = False
        self._live: set[Sandbox] = set()
        self._finalizer = weakref.finalize(self, kill_sandboxes, self._live)
        self._calls = 0
        self._total_seconds = 0.0
        self._errors = dict.fromkeys(ERROR_KINDS, 0)

    # --- the API

    async def call(self, name: str, arguments: dict | str, fixed: dict | None = None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a mapping, or the JSON text of one) without blocking the loop.

        ``fixed``: arguments the dataset sets for this row (verl's per-row ``tools_kwargs``), passed after the
        model's are checked against the schema and taking precedence over them, so a model cannot override
        them."""
        started = time.monotonic()
        spec, parsed, failure = self._prepare(name, arguments, fixed)
        if failure is not None:
            return self._finish(name, *failure, started)
        outcome = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, spec, parsed)
        return self._finish(name, *outcome, started)

    def call_sync(self, name: str, arguments: dict | str, fixed: dict | None = None) -> ToolResult:
        """:meth:`call` for scripts and tests: blocks until the result is there."""
        started = time.monotonic()
        spec, parsed, failure = self._prepare(name, arguments, fixed)
        return self._finish(name, *(failure or self._run(spec, parsed)), started)

    def check(self) -> list[str]:
        """Start every process and return one message per tool whose function cannot be imported or does not
        take the arguments its schema declares (empty when all can), for the trainer to raise as a config error
        before training starts. A process that cannot start at all (it dies or hangs while importing) gives
        one message naming every tool."""
        self._raise_if_closed()
        sandboxes = [self._idle.get() for _ in range(self.processes)]
        # all started before any is waited for, so that they import the tool functions in parallel
        sandboxes = [sandbox if _is_alive(sandbox) else self._replace(sandbox) for sandbox in sandboxes]
        problems: set[str] = set()
        for position, sandbox in enumerate(sandboxes):
            try:
                _ready(sandbox)
                problems.update(
                    f"tool {name!r} ({self.specs[name].function}): {message}"
                    for name, message in sandbox.import_errors.items()
                )
            except SandboxFailed as failure:
                self._retire(sandbox)
                sandboxes[position] = None
                problems.add(f"tools {', '.join(self.specs)}: {failure}")
        for sandbox in sandboxes:
            self._idle.put(sandbox)
        return sorted(problems)

    def stats(self) -> dict[str, float]:
        """Counters for metrics: ``calls``, ``errors`` and ``errors/<kind>`` for every kind, ``mean_seconds``."""
        with self._lock:
            return {
                "calls": self._calls,
                "errors": sum(self._errors.values()),
                **{f"errors/{kind}": count for kind, count in self._errors.items()},
                "mean_seconds": self._total_seconds / self._calls if self._calls else 0.0,
            }

    def close(self) -> None:
        """Kill the tool processes (a call in flight gets a ``crashed`` observation) and stop the threads."""
        with self._lock:
            self._closed = True
        self._finalizer()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # --- in the caller's thread: checks that need no tool process

    def _prepare(
        self, name: str, arguments, fixed: dict | None = None
    ) -> tuple[ToolSpec | None, dict | None, tuple[str, str] | None]:
        """The spec and parsed arguments of a call (with the ``fixed`` ones), or the ``(kind, text)`` of why
        it cannot run."""
        self._raise_if_closed()
        spec = self.specs.get(name)
        if spec is None:
            shown = _truncate(str(name), TOOL_NAME_MAX_LENGTH)  # the model wrote it: it may be any length
            tools = ", ".join(self.specs) or "none"
            return None, None, ("unknown_tool", f"error: unknown tool {shown!r}; the tools are: {tools}")
        try:
            return spec, {**_parse_arguments(spec, arguments), **(fixed or {})}, None
        except _BadArguments as problem:
            return (
                spec,
                None,
                ("bad_arguments", _truncate(f"error: bad arguments for {name}: {problem}", spec.max_output_chars)),
            )

    def _finish(self, name: str, kind: str, text: str, started: float) -> ToolResult:
        seconds = time.monotonic() - started
        error = None if kind == "ok" else kind
        with self._lock:
            self._calls += 1
            self._total_seconds += seconds
            if error is not None:
                self._errors[error] += 1
        if error is not None:
            logger.debug("tool %s failed (%s) after %.3f s", name, error, seconds)
        return ToolResult(text=text, ok=error is None, error=error, seconds=seconds)

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("this ToolRunner is closed")

    # --- on a thread that may block: one call in one tool process

    def _run(self, spec: ToolSpec, arguments: dict) -> tuple[str, str]:
        """Run one validated call in a free process; ``(kind, text)``. A process that times out or dies is
        replaced before the next call can take it."""
        sandbox = self._idle.get()
        healthy = False
        try:
            if not _is_alive(sandbox):
                sandbox = self._replace(sandbox)
            outcome = _run_call(_ready(sandbox), spec, arguments)
            healthy = True
            return outcome
        except SandboxFailed as failure:
            logger.warning("tool %s: %s; starting a fresh tool process", spec.name, failure)
            return failure.kind, _truncate(f"error: {failure}", spec.max_output_chars)
        finally:
            self._idle.put(sandbox if healthy else self._replace(sandbox))

    def _replace(self, sandbox: Sandbox | None) -> Sandbox | None:
        """Kill ``sandbox`` (if any) and start a fresh process in its place; None when the runner is closed or
        the start failed (logged; the next call tries again)."""
        self._retire(sandbox)
        with self._lock:  # under the lock, so that close() cannot miss a process started meanwhile
            if self._closed:
                return None
            try:
                fresh = Sandbox(
                    self._context, self._functions, self.start_timeout_s, parameters=self._parameters, answer=_answer
                )
            except OSError as error:
                logger.error("cannot start a tool process: %s", error)
                return None
            self._live.add(fresh)
        return fresh

    def _retire(self, sandbox: Sandbox | None) -> None:
        if sandbox is not None:
            sandbox.kill()
            with self._lock:
                self._live.discard(sandbox)


def _is_alive(sandbox: Sandbox | None) -> bool:
    return sandbox is not None and sandbox.process.is_alive()


def _ready(sandbox: Sandbox | None) -> Sandbox:
    """``sandbox`` once it has imported the tool functions; raises :class:`SandboxFailed` if it cannot."""
    if sandbox is None:
        raise SandboxFailed("start_failed", "cannot start a tool process (see the trainer's log)")
    sandbox.wait_ready()
    return sandbox


def _parse_arguments(spec: ToolSpec, arguments) -> dict:
    """``arguments`` (a mapping or JSON text) as a dict that fits the spec's parameters: required properties
    present, declared basic types and enums respected (nested values are the tool's to check)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise _BadArguments(f"arguments are not valid JSON ({error})") from None
    if not isinstance(arguments, dict):
        raise _BadArguments(f"arguments must be a JSON object, not {_json_type_name(arguments)}")
    try:
        json.dumps(arguments)  # the process gets them as JSON
    except (TypeError, ValueError) as error:
        raise _BadArguments(f"arguments are not JSON-serialisable ({error})") from None
    parameters = spec.schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        raise _BadArguments(f"missing required argument{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}")
    if parameters.get("additionalProperties") is False:
        unexpected = [name for name in arguments if name not in properties]
        if unexpected:
            raise _BadArguments(f"unexpected argument {unexpected[0]!r}; the arguments are: {', '.join(properties)}")
    for name, value in arguments.items():
        declared = properties.get(name, {})
        types = declared.get("type", [])
        types = types if isinstance(types, list) else [types]
        if types and not any(_has_json_type(value, kind) for kind in types):
            raise _BadArguments(f"argument {name!r} must be {' or '.join(types)}, not {_json_type_name(value)}")
        if "enum" in declared and value not in declared["enum"]:
            raise _BadArguments(f"argument {name!r} must be one of {declared['enum']!r}, not {value!r}")
    return arguments


def _has_json_type(value, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    return isinstance(value, JSON_TYPES[kind])


def _json_type_name(value) -> str:
    for kind in JSON_TYPES:
        if _has_json_type(value, kind):
            return kind
    return type(value).__name__


def _truncate(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and a marker saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [truncated: {len(text)} characters in all]"


def _run_call(sandbox: Sandbox, spec: ToolSpec, arguments: dict) -> tuple[str, str]:
    """Run one call in the (ready) ``sandbox``: ``(kind, text)`` as it answered; raises :class:`SandboxFailed`
    when it timed out or died (the caller then replaces it)."""
    request = {
        "tool": spec.name,
        "arguments": arguments,
        "memory_mb": spec.memory_mb,
        "cpu_s": cpu_budget_s(spec.timeout_s),
        "max_output_chars": spec.max_output_chars,
    }
    try:
        reply = sandbox.exchange(request, spec.timeout_s)
    except ProcessEnded as ended:
        raise SandboxFailed("crashed", f"{spec.name} crashed: its process {ended}") from None
    if reply is None:
        raise SandboxFailed("timeout", f"{spec.name} timed out after {spec.timeout_s:g} s")
    if reply.get("kind") not in _PROCESS_KINDS or not isinstance(reply.get("text"), str):
        raise SandboxFailed("crashed", f"{spec.name} crashed: its process broke the message protocol")
    return reply["kind"], reply["text"]


# ------------------------------------------------------------------------------ inside a tool process

_PROCESS_KINDS = ("ok", "unavailable", "raised", "bad_return", "memory")
"""The kinds a tool process itself reports; timeouts, deaths and failed starts are seen by the trainer."""


class _NotSerialisable(Exception):
    """The tool returned a value that is neither ``str`` nor JSON-serialisable; the message names its type."""


def _answer(request: dict, callables: dict, import_errors: dict[str, str]) -> dict:
    """Run one call under its limits: ``{"kind": ..., "text": ...}`` with ``text`` cut to the tool's maximum."""
    name = request["tool"]
    if name in import_errors:
        kind, text = "unavailable", f"error: tool {name} is unavailable: {import_errors[name]}"
    else:
        set_soft_limit(resource.RLIMIT_AS, _address_space_bytes() + (request["memory_mb"] << 20))
        set_soft_limit(resource.RLIMIT_CPU, math.ceil(time.process_time()) + request["cpu_s"])
        try:
            kind, text = "ok", _call(callables[name], request["arguments"])
        except MemoryError:
            kind, text = "memory", f"error: {name} ran out of memory (it may use {request['memory_mb']} MB per call)"
        except _NotSerialisable as error:
            kind, text = "bad_return", f"error: {name} returned {error}, which is neither text nor JSON-serialisable"
        except BaseException as error:  # noqa: BLE001 - whatever a tool raises (SystemExit too) is an observation
            kind, text = "raised", f"error: {name} raised {type(error).__name__}: {describe_error(error)}"
    return {"kind": kind, "text": _truncate(text, request["max_output_chars"])}


def _call(function, arguments: dict) -> str:
    """The tool's result as text (an ``async def`` tool is awaited)."""
    value = function(**arguments)
    if inspect.iscoroutine(value):
        value = asyncio.run(value)
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # TypeError: no JSON form; ValueError: a circular reference
        raise _NotSerialisable(f"a {type(value).__name__}") from None


def _address_space_bytes() -> int:
    """This process's virtual memory size now (Linux), the base of a call's RLIMIT_AS."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
