"""Custom reward scorers in a process of their own: a scorer that ends its process (``os._exit``, a crash)
is reported as such, and one that hangs is killed at its deadline; neither ends nor hangs the trainer.

A :class:`ScorerProcess` is called like the scorer it runs and scores exactly as in-process scoring would (the child
converts with :func:`~ppoflow.algorithms.scoring.as_score`; floats return as JSON). The child is a sandbox process of
:mod:`ppoflow.workers.service.tools`, kept between calls and replaced after it died or passed
``custom_reward_function.timeout_s`` (:class:`ScorerTimedOut`, or ``timeout_score``). It pickles as its settings, so
Ray reward chunks can take it. Built-in scorers stay in the trainer, but for those that call math-verify (sympy can
run for ever), each in a scorer process with the same deadline (:class:`RunBuiltinScorers`).
Details: docs/reliability.md#a-custom-scorer-has-a-deadline.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import resource
import threading
import time
import weakref
from typing import TYPE_CHECKING

from ppoflow.algorithms.math_scoring import MATH_VERIFY_SCORERS
from ppoflow.algorithms.scoring import (
    SCORER_TIMEOUTS,
    BuiltinScorers,
    Scorer,
    ScorerFailed,
    ScorerTimedOut,
    ScorerUnavailable,
    as_score,
    call_scorer,
    sample_being_scored,
    scorer_function,
)
from ppoflow.storage import bounded
from ppoflow.workers.service.sandbox import (
    ProcessEnded,
    Sandbox,
    SandboxFailed,
    cpu_budget_s,
    describe_error,
    kill_sandboxes,
    set_soft_limit,
)

if TYPE_CHECKING:  # the child imports this module: no pydantic there
    from ppoflow.configs.schema import CustomRewardConfig

logger = logging.getLogger(__name__)

_SCORER = "scorer"
"""The name of the one function a scorer process imports."""


class ScorerProcess:
    """The custom scorer ``path`` + ``name`` (``custom_reward_function``), run in a child process.

    ``start_timeout_s`` bounds starting the child and importing the scorer, ``timeout_s`` one call; a call past
    it kills the child and, with ``on_timeout="fail"``, is a :class:`ScorerTimedOut`, with ``"score"`` scores
    ``timeout_score`` with a warning (every score then carries :data:`SCORER_TIMEOUTS`: 1 for those, else 0).
    Every other failure is a :class:`ScorerFailed` naming the scorer (:class:`ScorerUnavailable` when the child
    cannot start or import it): as ``title`` (default ``the custom scorer 'path:name'``). ``error_score`` is what
    :func:`~ppoflow.algorithms.scoring.score_one` scores a failed response (None: it raises). :meth:`close` (or
    ``with``) ends the child, and so do garbage collection and the interpreter's exit.
    """

    def __init__(
        self,
        path: str,
        name: str,
        *,
        timeout_s: float,
        on_timeout: str = "fail",
        timeout_score: float = 0.0,
        error_score: float | None = None,
        title: str | None = None,
        start_timeout_s: float = 60.0,
    ):
        self.path, self.name = path, name
        self.label = repr(scorer_function(path, name))
        self.title = title or f"the custom scorer {self.label}"
        self.timeout_s, self.on_timeout, self.timeout_score = timeout_s, on_timeout, timeout_score
        self.error_score = error_score
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self._live: set[Sandbox] = set()
        self._finalizer = weakref.finalize(self, kill_sandboxes, self._live)

    def __call__(self, data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict[str, float]:
        """The score of one response as ``{"score": ..., **extras}``; :class:`ScorerFailed` when the scorer cannot
        be imported, raises, returns something that is not a score, passes its deadline (unless
        ``on_timeout="score"``) or ends its process."""
        args = [data_source, solution_str, ground_truth, extra_info]
        try:
            request = {
                "args": json.loads(json.dumps(args, default=_as_json)),
                "cpu_s": cpu_budget_s(self.timeout_s),
            }
        except (TypeError, ValueError) as error:
            raise ScorerFailed(f"{self.title} cannot be sent its arguments: {error}") from None
        with self._lock:
            sandbox = self._ready()
            try:
                reply = self._reply(sandbox, request)
            except ProcessEnded as ended:
                self._retire()
                raise ScorerFailed(f"{self.title} crashed: its process {ended}") from None
            if reply is None:
                self._retire()
                return self._timed_out()
        if reply.get("kind") != "ok":
            raise ScorerFailed(f"{self.title} {reply.get('text')}")
        return reply["score"] if self.on_timeout == "fail" else {**reply["score"], SCORER_TIMEOUTS: 0.0}

    def import_error(self) -> str | None:
        """Start the child if needed; why the scorer cannot be imported (None when it can). Raises
        :class:`ScorerFailed` when the child cannot start (it dies or hangs while importing)."""
        with self._lock:
            sandbox = self._started()
            return sandbox.import_errors.get(_SCORER)

    def close(self) -> None:
        """End the child (a later call starts a fresh one)."""
        with self._lock:
            self._retire()

    def __enter__(self) -> ScorerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __reduce__(self):
        return shared_scorer_process, (
            self.path,
            self.name,
            self.timeout_s,
            self.on_timeout,
            self.timeout_score,
            self.error_score,
            self.title,
        )

    def _reply(self, sandbox: Sandbox, request: dict) -> dict | None:
        """The child's reply to ``request``, or None when none came within :attr:`timeout_s`; while the call
        lasts, a warning every :data:`~ppoflow.storage.bounded.REPORT_EVERY_S` names the response."""
        sandbox.send(request)
        started = time.monotonic()
        while True:
            left = self.timeout_s - (time.monotonic() - started)
            reply = sandbox.receive(max(0.0, min(bounded.REPORT_EVERY_S, left)))
            waited = time.monotonic() - started
            if reply is not None or waited >= self.timeout_s:
                return reply
            logger.warning(
                "%s has been scoring %s for %.0f s (custom_reward_function.timeout_s=%g)",
                self.title,
                sample_being_scored(),
                waited,
                self.timeout_s,
            )

    def _timed_out(self) -> dict[str, float]:
        """A call past :attr:`timeout_s` (its child killed): :class:`ScorerTimedOut`, or the timeout score."""
        late = f"did not return within custom_reward_function.timeout_s={self.timeout_s:g} s (its process was killed)"
        if self.on_timeout == "fail":
            raise ScorerTimedOut(f"{self.title} {late}")
        logger.warning(
            "%s %s while scoring %s: it scores custom_reward_function.timeout_score=%g (on_timeout=score)",
            self.title,
            late,
            sample_being_scored(),
            self.timeout_score,
        )
        return {"score": self.timeout_score, SCORER_TIMEOUTS: 1.0}

    def _started(self) -> Sandbox:
        """The child, started (again, if it died) and done importing the scorer."""
        if self._sandbox is None or not self._sandbox.process.is_alive():
            self._retire()
            self._sandbox = Sandbox(
                multiprocessing.get_context("spawn"),
                {_SCORER: scorer_function(self.path, self.name)},
                self.start_timeout_s,
                answer=_score,
                role="scorer",
            )
            self._live.add(self._sandbox)
        try:
            self._sandbox.wait_ready()
        except SandboxFailed as failure:
            self._retire()
            raise ScorerUnavailable(f"{self.title} cannot start: {failure}") from None
        return self._sandbox

    def _ready(self) -> Sandbox:
        sandbox = self._started()
        if _SCORER in sandbox.import_errors:
            raise ScorerUnavailable(f"{self.title} cannot be loaded: {sandbox.import_errors[_SCORER]}")
        return sandbox

    def _retire(self) -> None:
        if self._sandbox is not None:
            self._sandbox.kill()
            self._live.discard(self._sandbox)
            self._sandbox = None


class RunBuiltinScorers(BuiltinScorers):
    """A run's built-in scorers: those that call math-verify (:data:`MATH_VERIFY_SCORERS`) each in a scorer process
    of this process's (:func:`shared_scorer_process`, started on the first call) with the custom scorer's deadline
    and ``on_timeout``, the others in this process. Pickles as its settings."""

    def __init__(self, *, timeout_s: float, on_timeout: str, timeout_score: float, error_score: float):
        super().__init__(error_score)
        self.timeout_s, self.on_timeout, self.timeout_score = timeout_s, on_timeout, timeout_score

    def scorer(self, data_source: str) -> Scorer:
        scorer = super().scorer(data_source)
        if scorer not in MATH_VERIFY_SCORERS:
            return scorer
        name = scorer.__name__
        settings = (self.timeout_s, self.on_timeout, self.timeout_score, None, f"the built-in scorer {name}")
        return shared_scorer_process(scorer.__module__, name, *settings)


def configured_scorer(custom: CustomRewardConfig) -> ScorerProcess | RunBuiltinScorers:
    """The run's scorer: the custom one (``custom_reward_function``) in a process of its own, else the built-in
    ones; a response either fails on scores ``custom_reward_function.error_score``."""
    if not custom.path:
        return RunBuiltinScorers(
            timeout_s=custom.timeout_s,
            on_timeout=custom.on_timeout,
            timeout_score=custom.timeout_score,
            error_score=custom.error_score,
        )
    return ScorerProcess(
        custom.path,
        custom.name,
        timeout_s=custom.timeout_s,
        on_timeout=custom.on_timeout,
        timeout_score=custom.timeout_score,
        error_score=custom.error_score,
    )


_SHARED: dict[tuple, ScorerProcess] = {}
_SHARED_LOCK = threading.Lock()


def shared_scorer_process(
    path: str,
    name: str,
    timeout_s: float,
    on_timeout: str,
    timeout_score: float,
    error_score: float | None = None,
    title: str | None = None,
) -> ScorerProcess:
    """This process's one :class:`ScorerProcess` for these settings (what an unpickled one is), so that the
    reward chunks a Ray worker runs one after the other share one child."""
    key = (path, name, timeout_s, on_timeout, timeout_score, error_score, title)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = ScorerProcess(
                path,
                name,
                timeout_s=timeout_s,
                on_timeout=on_timeout,
                timeout_score=timeout_score,
                error_score=error_score,
                title=title,
            )
        return _SHARED[key]


def _as_json(value):
    """numpy values (a ground truth read from parquet) as the lists and numbers the scorer would compare."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON-serialisable")


# ------------------------------------------------------------------------------ inside a scorer process


def _score(request: dict, callables: dict, import_errors: dict[str, str]) -> dict:
    """Score one response: ``{"kind": "ok", "score": {...}}``, or ``{"kind": ..., "text": ...}`` saying what the
    scorer did instead (raised, returned something that is not a score)."""
    set_soft_limit(resource.RLIMIT_CPU, math.ceil(time.process_time()) + request["cpu_s"])
    try:
        result = call_scorer(callables[_SCORER], *request["args"])
    except BaseException as error:  # noqa: BLE001 - whatever a scorer raises (SystemExit too) is reported
        return {"kind": "raised", "text": f"raised {type(error).__name__}: {describe_error(error)}"}
    try:
        score, extras = as_score(result)
    except ValueError as error:
        return {"kind": "bad_return", "text": str(error)}
    return {"kind": "ok", "score": {"score": score, **extras}}
