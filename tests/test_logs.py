"""What the run's log lines keep of an exception: a traceback for a bug, only the message for bad input, a
run failure that says it all, or a rejected cache entry (``ppoflow train`` installs the filter)."""

from __future__ import annotations

import logging
import sys

import pytest

from ppoflow.algorithms.scoring import ScorerFailed
from ppoflow.configs import ConfigError
from ppoflow.flows.logs import hide_user_error_tracebacks
from ppoflow.storage.step_cache.entry_check import CacheEntryRejected


def logged(error: Exception, caplog) -> logging.LogRecord:
    """The record ``prefect.task_runs`` logs for ``error`` (with its exc_info), after the filters."""
    from prefect.settings import PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW, temporary_settings

    logger = logging.getLogger("prefect.task_runs")
    try:
        raise error
    except Exception:
        # outside a flow run, Prefect's API handler on this logger would warn that it has nowhere to send it
        with temporary_settings({PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW: "ignore"}):
            with caplog.at_level(logging.ERROR, logger="prefect.task_runs"):
                logger.error("Task run failed with exception: %r", error, exc_info=sys.exc_info())
    return caplog.records[-1]


@pytest.mark.parametrize(
    "error",
    [CacheEntryRejected("the payload is damaged"), ConfigError([("x", "bad")]), ScorerFailed("the judge is down")],
    ids=["rejected entry", "config error", "scorer failed"],
)
def test_the_message_says_it_all_so_no_traceback(error, caplog):
    hide_user_error_tracebacks()
    record = logged(error, caplog)
    assert record.exc_info is None and repr(error) in record.getMessage()


def test_a_bug_keeps_its_traceback(caplog):
    hide_user_error_tracebacks()
    assert logged(RuntimeError("a bug"), caplog).exc_info is not None
