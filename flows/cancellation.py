"""Stop a ``ppoflow train`` run whose flow run is cancelled (the UI's Cancel, ``prefect flow-run cancel``).

Prefect stops a cancelled flow run only where a runner or a worker started it: they send its process
SIGTERM. ``ppoflow train`` calls the flow itself, so nothing would stop it: it would train on under a
"Cancelling" badge. :func:`watch` (called by the flow) asks for the flow run's state every :data:`POLL_S`
from a thread and, once it is Cancelling, sends this process SIGTERM, which ``ppoflow train`` turns into a
clean stop (checkpoint kept, workers and servers stopped, exit 143); :func:`record_cancelled` then records
the run as Cancelled rather than Crashed. Only the process that owns the run opts in
(:func:`stop_process_on_cancel`): a signal is the right answer only where the process is the run's own.
"""

from __future__ import annotations

import contextvars
import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

POLL_S = 5.0
"""How often the flow run's state is read: one small request to the server."""

_stops_process = False
_cancelled: list[str] = []
"""The flow run whose cancellation stopped this process (at most one)."""


def stop_process_on_cancel() -> None:
    """Make :func:`watch` stop this process (SIGTERM) when its flow run is cancelled."""
    global _stops_process
    _stops_process = True


def watch(flow_run_id: str | None) -> None:
    """Watch ``flow_run_id``'s state from a daemon thread, if this process asked to be stopped on cancel."""
    if not _stops_process or flow_run_id is None:
        return
    context = contextvars.copy_context()  # the flow's Prefect settings: which server to ask
    threading.Thread(target=context.run, args=(_watch, flow_run_id), name="ppoflow-cancel-watch", daemon=True).start()


def _watch(flow_run_id: str) -> None:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        while True:
            time.sleep(POLL_S)
            try:
                state = client.read_flow_run(flow_run_id).state
            except Exception as error:  # the server is busy or restarting: ask again later
                logger.debug("could not read the state of flow run %s: %r", flow_run_id, error)
                continue
            if state is None:
                continue
            if state.is_cancelling() or state.is_cancelled():
                logger.warning("the flow run was cancelled in Prefect: stopping the run (checkpoint kept)")
                _cancelled.append(flow_run_id)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if state.is_final():
                return


def was_cancelled() -> bool:
    """Whether a cancellation in Prefect stopped this process."""
    return bool(_cancelled)


def record_cancelled() -> None:
    """Record the stopped flow run as Cancelled (the flow ended as Crashed on the way out of the signal)."""
    from prefect import get_client
    from prefect.states import Cancelled

    try:
        with get_client(sync_client=True) as client:
            for flow_run_id in _cancelled:
                client.set_flow_run_state(
                    flow_run_id,
                    Cancelled(message="cancelled in Prefect: ppoflow train stopped, its last checkpoint kept"),
                    force=True,
                )
    except Exception as error:  # the server is gone: the run stays Crashed there, the process stopped all the same
        logger.warning("could not record flow run %s as Cancelled: %r", _cancelled[0], error)
