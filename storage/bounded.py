"""Storage calls with a deadline, for optional storage a run must never wait on forever.

An object store can stall (an endpoint that accepts the connection and never answers, a partition): the
call blocks, and with it the training step. :func:`bounded` runs a call in a daemon thread, logs a
warning every few seconds while it lasts (so a stall is visible as it happens, not only afterwards), and
gives up at the deadline with :class:`StorageStalled`; the caller then treats the storage as failed for
this call (the step cache computes the stage instead). The abandoned thread ends when the call returns or
the client's own timeouts fire (:func:`client_timeouts` sets them for S3), and it cannot keep the process
alive.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

REPORT_EVERY_S = 5.0
"""How often a call still running is reported."""


class StorageStalled(TimeoutError):
    """A storage call that did not finish before its deadline."""


def bounded(call: Callable[[], T], *, timeout_s: float, what: str) -> T:
    """``call()``'s result, or its exception; :class:`StorageStalled` when it runs past ``timeout_s``.
    The call sees this thread's context variables."""
    outcome: list = []
    finished = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as error:  # handed to the caller's thread
            outcome.append((False, error))
        finally:
            finished.set()

    context = contextvars.copy_context()  # e.g. Prefect's flow-run context, for a task called inside
    threading.Thread(target=context.run, args=(run,), name=f"bounded:{what}", daemon=True).start()
    waited = 0.0
    while not finished.wait(min(REPORT_EVERY_S, timeout_s - waited)):
        waited = min(waited + REPORT_EVERY_S, timeout_s)
        if waited >= timeout_s:
            raise StorageStalled(f"{what} did not finish within {timeout_s:g} s")
        logger.warning("%s: still waiting after %.0f s (gives up at %g s)", what, waited, timeout_s)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def client_timeouts(url: str, storage_options: dict, *, timeout_s: float, retries: int) -> dict:
    """``storage_options`` with the client's own connect/read timeouts and retry count set from the same
    bounds (S3 through botocore's ``config_kwargs``), unless the options set them already."""
    if not url.startswith(("s3://", "s3a://")):
        return dict(storage_options)
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", timeout_s)
    config.setdefault("read_timeout", timeout_s)
    config.setdefault("retries", {"max_attempts": retries + 1, "mode": "standard"})
    return {**storage_options, "config_kwargs": config}
