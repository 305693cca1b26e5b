"""Custom reward scorers in a process of their own: a scorer that ends its process (``os._exit``, a crash)
is reported as such, and never ends the trainer.

A :class:`ScorerProcess` is called like the scorer it runs (verl's ``compute_score`` arguments) and scores
exactly as calling the scorer in the trainer would: the child calls it and converts what it returned with
:func:`~ppoflow.algorithms.scoring.as_score`, the function in-process scoring uses, and the floats travel
back as JSON, which round-trips every float. The child is a sandbox process of :mod:`ppoflow.workers.tools`
(spawned, ended with its parent, JSON on its pipe), started on the first call and kept for the next ones;
one that died is replaced on the next call. A ScorerProcess pickles as its path and name (the reward
chunks of ``reward_model.reward_manager=ray`` take it to Ray workers), and each process that unpickles one
keeps one child per scorer. Built-in scorers stay in the trainer: they are ppoflow's own, and fast.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import resource
import threading
import time
import weakref

from ppoflow.algorithms.scoring import ScorerFailed, as_score, scorer_function
from ppoflow.workers.tools import ProcessEnded, Sandbox, SandboxFailed, describe_error, kill_sandboxes, set_soft_limit

SCORE_CPU_S = 600
"""CPU seconds one scoring call may use: the backstop of a child that keeps spinning after its trainer died
(a call has no wall-clock deadline unless ``call_timeout_s`` gives one)."""

_SCORER = "scorer"
"""The name of the one function a scorer process imports."""


class ScorerProcess:
    """The custom scorer ``path`` + ``name`` (``custom_reward_function``), run in a child process.

    ``start_timeout_s`` bounds starting the child and importing the scorer; ``call_timeout_s`` (None: no
    limit) one call. Every failure is a :class:`ScorerFailed` naming the scorer. :meth:`close` (or ``with``)
    ends the child, and so do garbage collection and the interpreter's exit.
    """

    def __init__(self, path: str, name: str, *, start_timeout_s: float = 60.0, call_timeout_s: float | None = None):
        self.path, self.name = path, name
        self.label = repr(scorer_function(path, name))
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self._lock = threading.Lock()
        self._sandbox: Sandbox | None = None
        self._live: set[Sandbox] = set()
        self._finalizer = weakref.finalize(self, kill_sandboxes, self._live)

    def __call__(self, *args) -> dict[str, float]:
        """The score of ``args`` as ``{"score": ..., **extras}``; :class:`ScorerFailed` when the scorer cannot
        be imported, raises, returns something that is not a score, passes its deadline or ends its process."""
        try:
            request = {"args": json.loads(json.dumps(list(args), default=_as_json)), "cpu_s": SCORE_CPU_S}
        except (TypeError, ValueError) as error:
            raise ScorerFailed(f"the custom scorer {self.label} cannot be sent its arguments: {error}") from None
        with self._lock:
            sandbox = self._ready()
            try:
                reply = sandbox.exchange(request, self.call_timeout_s)
            except ProcessEnded as ended:
                self._retire()
                raise ScorerFailed(f"the custom scorer {self.label} crashed: its process {ended}") from None
            if reply is None:
                self._retire()
                raise ScorerFailed(f"the custom scorer {self.label} did not return within {self.call_timeout_s:g} s")
        if reply.get("kind") != "ok":
            raise ScorerFailed(f"the custom scorer {self.label} {reply.get('text')}")
        return reply["score"]

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
        return shared_scorer_process, (self.path, self.name)

    def _started(self) -> Sandbox:
        """The child, started (again, if it died) and done importing the scorer."""
        if self._sandbox is None or not self._sandbox.process.is_alive():
            self._retire()
            self._sandbox = Sandbox(multiprocessing.get_context("spawn"), {_SCORER: scorer_function(self.path,
                                     self.name)}, self.start_timeout_s, answer=_score, role="scorer")
            self._live.add(self._sandbox)
        try:
            self._sandbox.wait_ready()
        except SandboxFailed as failure:
            self._retire()
            raise ScorerFailed(f"the custom scorer {self.label} cannot start: {failure}") from None
        return self._sandbox

    def _ready(self) -> Sandbox:
        sandbox = self._started()
        if _SCORER in sandbox.import_errors:
            raise ScorerFailed(f"the custom scorer {self.label} cannot be loaded: {sandbox.import_errors[_SCORER]}")
        return sandbox

    def _retire(self) -> None:
        if self._sandbox is not None:
            self._sandbox.kill()
            self._live.discard(self._sandbox)
            self._sandbox = None


_SHARED: dict[tuple[str, str], ScorerProcess] = {}
_SHARED_LOCK = threading.Lock()


def shared_scorer_process(path: str, name: str) -> ScorerProcess:
    """This process's one :class:`ScorerProcess` for ``path`` + ``name`` (what an unpickled one is), so that
    the reward chunks a Ray worker runs one after the other share one child."""
    with _SHARED_LOCK:
        if (path, name) not in _SHARED:
            _SHARED[path, name] = ScorerProcess(path, name)
        return _SHARED[path, name]


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
        result = callables[_SCORER](*request["args"])
    except BaseException as error:  # noqa: BLE001 - whatever a scorer raises (SystemExit too) is reported
        return {"kind": "raised", "text": f"raised {type(error).__name__}: {describe_error(error)}"}
    try:
        score, extras = as_score(result)
    except ValueError as error:
        return {"kind": "bad_return", "text": str(error)}
    return {"kind": "ok", "score": {"score": score, **extras}}
