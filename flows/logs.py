"""What a run tells its user, said once on the console and kept in the Prefect UI's logs.

A *note* (:func:`note`) is a line a user follows the run by (start-up phases, validation results, checkpoints,
resumes); the console prints it once, above the progress bar, and the ``ppoflow.run`` logger carries it to the flow
run's logs. Inside a flow run :func:`logs_to_prefect` sends every ``ppoflow`` record from INFO up to Prefect's API,
attached to the task run it was logged in or else to the flow run; the console shows what it showed without it.
Prefect's per-task "Finished in state Completed()" line is left out of both. Details: docs/ui.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.context import FlowRunContext, TaskRunContext
from prefect.logging.handlers import APILogHandler
from tqdm.auto import tqdm

PACKAGE_LOGGER = logging.getLogger("ppoflow")
NOTES = PACKAGE_LOGGER.getChild("run")


def note(message: str) -> None:
    """Print ``message`` on the console (above a progress bar, if one is shown) and log it for the UI."""
    tqdm.write(message)
    NOTES.info(message)


def _in_a_run(record: logging.LogRecord) -> bool:
    """Only records logged where a flow or task run is current go to the API (a thread of a storage
    client, say, has no run to attach them to)."""
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class _WarningsOnward(logging.Handler):
    """Hands warnings and errors on to the root logger's handlers (Prefect's console, pytest's capture,
    or Python's last resort), as if the ``ppoflow`` logger still propagated them."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().callHandlers(record)


def run_failures() -> tuple[type[Exception], ...]:
    """What ends a run for a reason its one-line message says whole - a training value that is not finite,
    a custom scorer that failed, a rollout whose every generation fails - and is reported as that line
    (exit 1), as bad input is (exit 2)."""
    from ppoflow.algorithms.finite import NonFiniteError
    from ppoflow.algorithms.scoring import ScorerFailed
    from ppoflow.workers.service.rollout_service import RolloutFailing

    return NonFiniteError, ScorerFailed, RolloutFailing


def _without_user_error_traceback(record: logging.LogRecord) -> bool:
    """Keep the record, without its traceback when its exception is the user's input (a ConfigError), a
    run failure whose message says it all (:func:`run_failures`) or a rejected cache entry (its reason)."""
    from ppoflow.configs import ConfigError
    from ppoflow.storage.step_cache.entry_check import CacheEntryRejected

    if record.exc_info and isinstance(record.exc_info[1], (ConfigError, CacheEntryRejected, *run_failures())):
        record.exc_info = record.exc_text = None
    return True


def hide_user_error_tracebacks() -> None:
    """Prefect logs a failed task or flow run's exception with its traceback. A :class:`ConfigError` raised
    inside a run (a role asking for more than the Ray cluster has, say) is bad input, not a bug, and a run
    failure (:func:`run_failures`) says where it arose, and a rejected cache entry's reason is the whole story
    (the stage is recomputed): their lines keep the message and drop the traceback, as ``ppoflow train``
    reports bad input found before Prefect starts. Idempotent."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if _without_user_error_traceback not in logger.filters:
            logger.addFilter(_without_user_error_traceback)


@contextmanager
def logs_to_prefect() -> Iterator[None]:
    """For the block's duration, send ``ppoflow`` records (INFO and up) to the current flow run's logs.

    Only warnings and errors go on to the console (the root logger's handlers), as before: notes print
    through :func:`note`, never through logging, so nothing appears twice."""
    if FlowRunContext.get() is None:
        yield
        return
    api = APILogHandler()
    api.setLevel(logging.INFO)
    api.addFilter(_in_a_run)
    handlers = [api, _WarningsOnward()]
    level, propagate = PACKAGE_LOGGER.level, PACKAGE_LOGGER.propagate
    task_runs = logging.getLogger("prefect.task_runs")
    task_runs_level = task_runs.level
    PACKAGE_LOGGER.setLevel(logging.INFO)
    PACKAGE_LOGGER.propagate = False
    task_runs.setLevel(logging.WARNING)
    for handler in handlers:
        PACKAGE_LOGGER.addHandler(handler)
    try:
        yield
    finally:
        for handler in handlers:
            PACKAGE_LOGGER.removeHandler(handler)
        PACKAGE_LOGGER.setLevel(level)
        PACKAGE_LOGGER.propagate = propagate
        task_runs.setLevel(task_runs_level)
