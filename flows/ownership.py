"""Who owns a run directory: one run at a time writes ``trainer.default_local_dir``.

:func:`own_run_directory` holds the directory's lock (:mod:`ppoflow.storage.run_lock`) around a run, with
the current Prefect flow run recorded as its owner, and applies ``trainer.run_dir_busy`` when another live
run holds it: ``fail`` is a :class:`ConfigError` naming the directory and its owner (``ppoflow train``
exits 2 before Ray or a model starts); ``wait`` polls until the owner ends, giving up after
``trainer.run_dir_wait_s`` when set. The lock is released however the run ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.context import FlowRunContext

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig, TrainerConfig
from ppoflow.storage.run_lock import RunDirectoryBusy, RunLock, claim

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often a waiting run looks at the lock again."""


@contextmanager
def own_run_directory(cfg: PPOConfig, *, poll_s: float = POLL_S) -> Iterator[RunLock]:
    """Hold the run directory's lock for the block, per ``trainer.run_dir_busy``; :class:`ConfigError` when
    it is owned by another live run (``fail``) or still is after ``trainer.run_dir_wait_s`` (``wait``)."""
    with _claim_per_policy(cfg.trainer, poll_s) as lock:
        yield lock


def _claim_per_policy(trainer: TrainerConfig, poll_s: float) -> RunLock:
    context = FlowRunContext.get()
    flow_run = context.flow_run if context is not None else None
    flow_run_id, flow_run_name = (str(flow_run.id), flow_run.name) if flow_run is not None else (None, None)
    deadline = None if trainer.run_dir_wait_s is None else time.monotonic() + trainer.run_dir_wait_s
    waiting = False
    while True:
        try:
            return claim(trainer.default_local_dir, flow_run_id=flow_run_id, flow_run_name=flow_run_name)
        except RunDirectoryBusy as busy:
            if trainer.run_dir_busy == "fail":
                raise ConfigError(
                    [
                        (
                            "trainer.default_local_dir",
                            f"{busy}; wait for it to end, choose another directory, or set trainer.run_dir_busy=wait",
                        )
                    ]
                ) from None
            if deadline is not None and time.monotonic() >= deadline:
                raise ConfigError(
                    [
                        (
                            "trainer.default_local_dir",
                            f"{busy}, still after waiting trainer.run_dir_wait_s={trainer.run_dir_wait_s} s",
                        )
                    ]
                ) from None
            if not waiting:
                logger.warning("%s; waiting for it to end (trainer.run_dir_busy=wait)", busy)
                waiting = True
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))
