"""Running tools for multi-turn agent loops: each call in a sandbox process, bounded in time and memory.

:class:`ToolRunner` runs the calls of :mod:`workers.agent_loop` in ``spawn``ed processes (the caller may be a
multi-threaded Ray actor) that import the tool functions once and run every call under resource limits; whatever
goes wrong becomes an error observation for the model, never an exception or a hang in the trainer, and a process
that timed out or died is replaced. The same machinery runs custom scorers (:mod:`ppoflow.workers.scorer_process`).
Every tool process imports this module, so it imports nothing heavy at module level.
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
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ppoflow.algorithms.scoring import load_custom_scorer
from ppoflow.workers.tool_config import JSON_TYPES, TOOL_NAME_MAX_LENGTH, ToolSpec

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

_MAX_MESSAGE_BYTES = 16 << 20
"""The largest message the trainer reads from a tool process; replies are truncated well below this in the
tool process, so only a broken process sends more."""


def cpu_budget_s(wall_s: float) -> int:
    """CPU seconds a tool process may spend on work the trainer waits ``wall_s`` for (RLIMIT_CPU).

    Generous on purpose: the trainer's wall-clock timeout ends a slow call first. The limit is the
    backstop for a process that keeps spinning after the trainer died (or hung) and cannot kill it.
    """
    return math.ceil(60 + 10 * wall_s)


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


class ProcessEnded(Exception):
    """A tool process died (or broke the message protocol); the message says how it ended."""


class SandboxFailed(Exception):
    """A tool process timed out, died or did not start; ``kind`` is the error kind, the message says what
    happened (the observation is ``error: <message>``)."""

    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


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
            outcome = _ready(sandbox).run(spec, arguments)
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
                fresh = Sandbox(self._context, self._functions, self.start_timeout_s, parameters=self._parameters)
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


def kill_sandboxes(sandboxes: set[Sandbox]) -> None:
    """Kill and reap every process in ``sandboxes`` (ToolRunner.close, garbage collection, interpreter exit)."""
    for sandbox in list(sandboxes):
        sandbox.kill()
    sandboxes.clear()


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


class Sandbox:
    """One tool process and the trainer's end of its pipe.

    ``import_errors`` (tool name -> why its function cannot be imported, or cannot take the arguments its
    schema declares: ``parameters``, tool name -> property names) is None until the process has imported
    the functions and said so. ``answer`` (a module-level function, run in the process) answers each request:
    :func:`_answer` runs tool calls, :mod:`ppoflow.workers.scorer_process` passes its own; ``role`` names the
    process in messages.
    """

    def __init__(
        self,
        context,
        functions: dict[str, str],
        start_timeout_s: float,
        *,
        parameters: dict[str, list[str]] | None = None,
        answer=None,
        role: str = "tool",
    ):
        self.connection, child_end = context.Pipe()
        self.tool_names = set(functions)
        self.start_timeout_s = start_timeout_s
        self.process = context.Process(
            target=_serve,
            args=(child_end, functions, cpu_budget_s(start_timeout_s), parameters or {}, answer or _answer),
            name=f"ppoflow-{role}s",
            daemon=True,
        )
        self.role = role
        try:
            self.process.start()
        finally:
            child_end.close()
        self.import_errors: dict[str, str] | None = None

    def wait_ready(self) -> None:
        """Wait until the process has imported the tool functions; raises :class:`SandboxFailed`."""
        if self.import_errors is not None:
            return
        try:
            message = self.receive(self.start_timeout_s)
        except ProcessEnded as ended:
            raise SandboxFailed(
                "start_failed", f"the {self.role} process {ended} while importing the {self.role} functions"
            ) from None
        if message is None:
            raise SandboxFailed(
                "start_failed",
                f"the {self.role} process did not finish importing the {self.role} "
                f"functions within {self.start_timeout_s:g} s",
            )
        errors = message.get("import_errors")
        if (
            not isinstance(errors, dict)
            or not set(errors) <= self.tool_names
            or not all(isinstance(text, str) for text in errors.values())
        ):
            raise SandboxFailed("start_failed", f"the {self.role} process broke the message protocol")
        self.import_errors = errors

    def run(self, spec: ToolSpec, arguments: dict) -> tuple[str, str]:
        """Run one call in the (ready) process: ``(kind, text)`` as it answered; raises :class:`SandboxFailed`
        when it timed out or died (the caller then replaces it)."""
        request = {
            "tool": spec.name,
            "arguments": arguments,
            "memory_mb": spec.memory_mb,
            "cpu_s": cpu_budget_s(spec.timeout_s),
            "max_output_chars": spec.max_output_chars,
        }
        try:
            reply = self.exchange(request, spec.timeout_s)
        except ProcessEnded as ended:
            raise SandboxFailed("crashed", f"{spec.name} crashed: its process {ended}") from None
        if reply is None:
            raise SandboxFailed("timeout", f"{spec.name} timed out after {spec.timeout_s:g} s")
        if reply.get("kind") not in _PROCESS_KINDS or not isinstance(reply.get("text"), str):
            raise SandboxFailed("crashed", f"{spec.name} crashed: its process broke the message protocol")
        return reply["kind"], reply["text"]

    def exchange(self, request: dict, timeout_s: float | None) -> dict | None:
        """Send ``request`` to the (ready) process and return its reply, or None when none came within
        ``timeout_s`` (None: wait as long as it takes); raises :class:`ProcessEnded` when the process died."""
        self.send(request)
        return self.receive(timeout_s)

    def send(self, request: dict) -> None:
        """Send ``request`` to the (ready) process; raises :class:`ProcessEnded` when the process died. A caller
        that waits for the reply in slices (to report a long wait) reads it with :meth:`receive`."""
        try:
            self.connection.send_bytes(json.dumps(request).encode())
        except OSError:  # the pipe broke on sending: the process is gone
            raise ProcessEnded(self._ending()) from None

    def receive(self, timeout_s: float | None) -> dict | None:
        """The process's next message, or None when none came within ``timeout_s``; raises
        :class:`ProcessEnded` when the process died (or sent something that is not a message)."""
        try:
            if not self.connection.poll(timeout_s):
                return None
            message = json.loads(self.connection.recv_bytes(_MAX_MESSAGE_BYTES))
        except (EOFError, OSError, ValueError):
            message = None
        if not isinstance(message, dict):
            raise ProcessEnded(self._ending())
        return message

    def _ending(self) -> str:
        """How the process ended, in words (it is killed first if it is still running)."""
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        if code is None:
            self.kill()
            return "stopped answering"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def kill(self) -> None:
        """Kill the process, reap it (no zombie) and release its pipe."""
        self.process.kill()
        self.process.join(timeout=5.0)
        self.connection.close()


# ------------------------------------------------------------------------------ inside a tool process

_PROCESS_KINDS = ("ok", "unavailable", "raised", "bad_return", "memory")
"""The kinds a tool process itself reports; timeouts, deaths and failed starts are seen by the trainer."""


class _NotSerialisable(Exception):
    """The tool returned a value that is neither ``str`` nor JSON-serialisable; the message names its type."""


def _serve(connection, functions: dict[str, str], start_cpu_s: int, parameters: dict[str, list[str]], answer) -> None:
    """The main function of a tool process: import the functions (and check that each takes its schema's
    ``parameters`` by name), then ``answer`` requests until the trainer closes the pipe (or dies)."""
    threading.Thread(target=_exit_when_parent_dies, name="parent-watch", daemon=True).start()
    set_soft_limit(resource.RLIMIT_CPU, math.ceil(time.process_time()) + start_cpu_s)
    callables, import_errors = {}, {}
    for name, path in functions.items():
        source, _, attribute = path.rpartition(":")
        try:
            callables[name] = load_custom_scorer(source, attribute)
        except ValueError as error:
            import_errors[name] = str(error)
            continue
        mismatch = _signature_mismatch(callables[name], parameters.get(name, []))
        if mismatch:
            import_errors[name] = mismatch
    _send(connection, {"import_errors": import_errors})
    while True:
        try:
            request = json.loads(connection.recv_bytes())
        except (EOFError, OSError):  # the trainer closed the pipe, or died
            return
        _send(connection, answer(request, callables, import_errors))


def _signature_mismatch(function, parameters: list[str]) -> str | None:
    """Why ``function`` cannot be called with its schema's ``parameters`` as keyword arguments (None when it
    can). Parameters the schema leaves out may still come from the dataset's ``tools_kwargs``."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (some builtins): a call will tell
        return None
    accepted = signature.parameters.values()
    shown = f"{getattr(function, '__name__', 'the function')}{signature}"
    positional = [p.name for p in accepted if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        return f"{shown} takes {', '.join(map(repr, positional))} by position only; tools are called with keywords"
    if any(p.kind is p.VAR_KEYWORD for p in accepted):
        return None
    by_name = {p.name for p in accepted if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unknown = [name for name in parameters if name not in by_name]
    if unknown:
        return f"its tool_schema declares {', '.join(map(repr, unknown))}, which {shown} does not take"
    return None


def _exit_when_parent_dies() -> None:
    """End this process when the trainer's ends, even while a tool is stuck (blocked reads end anyway)."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def _send(connection, message: dict) -> None:
    """Send ``message`` as ASCII JSON: a lone surrogate in a tool's text is escaped, not an encoding error."""
    connection.send_bytes(json.dumps(message).encode())


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


def describe_error(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not take the tool process down
        return "(its message cannot be printed)"


def _address_space_bytes() -> int:
    """This process's virtual memory size now (Linux), the base of a call's RLIMIT_AS."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def set_soft_limit(which: int, soft: int) -> None:
    """Set a soft resource limit, capped by the hard one (left as it is, so later calls can raise the soft one)."""
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
