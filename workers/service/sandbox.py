"""Sandbox processes: user code (tool functions, custom scorers) in a ``spawn``ed process of its own.

:class:`Sandbox` is the trainer's end of one such process and its pipe; :func:`_serve` is the process's main
function: it imports the functions once, then answers requests (the ``answer`` function the caller passes:
:mod:`ppoflow.workers.service.tools` runs tool calls, :mod:`ppoflow.workers.service.scorer_process` scores)
under resource limits. Every sandbox process imports this module, so it imports nothing heavy at module level.
How a process is confined: docs/rollout_service.md#tools.
"""

from __future__ import annotations

import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import threading
import time

from ppoflow.algorithms.scoring import load_custom_scorer

_MAX_MESSAGE_BYTES = 16 << 20
"""The largest message the trainer reads from a tool process; replies are truncated well below this in the
tool process, so only a broken process sends more."""


def cpu_budget_s(wall_s: float) -> int:
    """CPU seconds a tool process may spend on work the trainer waits ``wall_s`` for (RLIMIT_CPU).

    Generous on purpose: the trainer's wall-clock timeout ends a slow call first. The limit is the
    backstop for a process that keeps spinning after the trainer died (or hung) and cannot kill it.
    """
    return math.ceil(60 + 10 * wall_s)


class ProcessEnded(Exception):
    """A tool process died (or broke the message protocol); the message says how it ended."""


class SandboxFailed(Exception):
    """A tool process timed out, died or did not start; ``kind`` is the error kind, the message says what
    happened (the observation is ``error: <message>``)."""

    def __init__(self, kind: str, text: str):
        super().__init__(text)
        self.kind = kind


def kill_sandboxes(sandboxes: set[Sandbox]) -> None:
    """Kill and reap every process in ``sandboxes`` (ToolRunner.close, garbage collection, interpreter exit)."""
    for sandbox in list(sandboxes):
        sandbox.kill()
    sandboxes.clear()


class Sandbox:
    """One sandbox process (of tools, or of a scorer) and the trainer's end of its pipe.

    ``import_errors`` (tool name -> why its function cannot be imported, or cannot take the arguments its
    schema declares: ``parameters``, tool name -> property names) is None until the process has imported
    the functions and said so. ``answer`` (a module-level function, run in the process) answers each request:
    :mod:`ppoflow.workers.service.tools` passes one that runs tool calls, :mod:`ppoflow.workers.service.scorer_process`
    one that scores; ``role`` names the
    process in messages.
    """

    def __init__(
        self,
        context,
        functions: dict[str, str],
        start_timeout_s: float,
        *,
        parameters: dict[str, list[str]] | None = None,
        answer,
        role: str = "tool",
    ):
        self.connection, child_end = context.Pipe()
        self.tool_names = set(functions)
        self.start_timeout_s = start_timeout_s
        self.process = context.Process(
            target=_serve,
            args=(child_end, functions, cpu_budget_s(start_timeout_s), parameters or {}, answer),
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


# ------------------------------------------------------------------------------ inside a sandbox process


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


def describe_error(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not take the tool process down
        return "(its message cannot be printed)"


def set_soft_limit(which: int, soft: int) -> None:
    """Set a soft resource limit, capped by the hard one (left as it is, so later calls can raise the soft one)."""
    _, hard = resource.getrlimit(which)
    resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
