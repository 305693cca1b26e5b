"""Nothing a ``ppoflow train`` started outlives it, however it ends (a SIGKILL included).

A SIGKILL cannot be caught, and Ray's fate-sharing (``PR_SET_PDEATHSIG``) reaches only the processes the driver
started itself: the temporary Prefect server and Ray's agents stayed behind. :func:`reap_on_exit` starts a
watchdog, once per process, in a session of its own (out of reach of a Ctrl-C or a kill of the trainer's process
group), and puts a marker of this process's own in the environment, which every process started from then on
inherits (the temporary server; Ray's GCS, raylet, agents, workers; scorer processes). When the trainer ends
(a pidfd), the watchdog stops every live process that carries the marker (SIGTERM, then SIGKILL after
:data:`GRACE_S`) and exits; after a normal end it finds none. A Ray cluster joined with ``ray.address``, a server
named by ``PREFECT_API_URL`` and other runs' processes carry no such marker. Linux only (``/proc``, pidfds).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

MARKER_ENV = "PPOFLOW_RUN_MARKER"
"""Set in the trainer's environment to a value of its own; every process that carries it dies with the run."""

GRACE_S = 10.0
"""How long a process that carries the marker has to exit after SIGTERM before it is SIGKILLed."""

_watchdog: subprocess.Popen | None = None


def reap_on_exit() -> None:
    """Start this process's watchdog (once) and mark the environment of every process it starts from now on."""
    global _watchdog
    if _watchdog is not None or not hasattr(os, "pidfd_open"):
        return
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"
    env = {name: value for name, value in os.environ.items() if name != MARKER_ENV}
    _watchdog = subprocess.Popen(
        [sys.executable, "-m", __name__, str(os.getpid()), marker],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    os.environ[MARKER_ENV] = marker  # after the watchdog started: it carries none


def marked_processes(marker: str) -> list[int]:
    """The pids of the live processes whose environment holds ``MARKER_ENV=marker`` (this one left out)."""
    wanted = f"{MARKER_ENV}={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if wanted in environ.read().split(b"\0"):  # a zombie's reads empty
                    found.append(int(name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def stop_marked(marker: str, grace_s: float = GRACE_S) -> None:
    """SIGTERM every process that carries ``marker``, SIGKILL those still alive ``grace_s`` later; look again
    until none is left (one may start another as it stops), giving up ``grace_s`` after the SIGKILLs."""
    deadline = time.monotonic() + grace_s
    terminated: set[int] = set()
    while (left := marked_processes(marker)) and time.monotonic() < deadline + grace_s:
        for pid in left:
            if pid not in terminated or time.monotonic() >= deadline:
                try:
                    os.kill(pid, signal.SIGKILL if pid in terminated else signal.SIGTERM)
                except ProcessLookupError:
                    pass
                terminated.add(pid)
        time.sleep(0.2)


def _watch(trainer: int, marker: str) -> None:
    """Wait for ``trainer`` (this process's parent) to end, then stop what carries its marker."""
    if os.getppid() == trainer:  # else it has ended already, and its pid may be another process's now
        try:
            select.select([os.pidfd_open(trainer)], [], [])  # readable once it has ended
        except ProcessLookupError:
            pass
    stop_marked(marker)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
