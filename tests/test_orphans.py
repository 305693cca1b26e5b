"""No process of a ``ppoflow train`` outlives it (:mod:`ppoflow.flows.reaper`).

* SIGKILLed once its temporary Prefect server and its own Ray (GCS, raylet, agents, actors) run, the run
  leaves none of them behind, and its watchdog exits too.
* A run that ends normally leaves none either.
* A run whose flow run is cancelled in Prefect stops (exit 143), is recorded Cancelled and leaves none.
* A run that joined a Ray cluster (``RAY_ADDRESS``) and a Prefect server (``PREFECT_API_URL``) leaves both
  running when it is SIGKILLed: only what it started dies with it.

Each run starts in a session of its own with a marker variable of the test's in its environment; its
processes are the live ones in that session or carrying the marker (which Ray's workers get too).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.preflight_helpers import DEMO_TRAIN

TREE_ENV = "PPOFLOW_TEST_TREE"
"""The test's own marker; ``PPOFLOW_`` variables are forwarded to Ray workers, on a joined cluster too."""

ACTOR = r"^ray::\w*Worker\b"
"""A run's Ray actor (``ray::ActorWorker``, ``ray::HFRolloutWorker.generate``, ...)."""


def processes_of(session: int, marker: str) -> dict[int, tuple[str, str]]:
    """The live processes (zombies left out) in ``session`` or with ``TREE_ENV=marker`` in their environment:
    pid -> (start time, command line)."""
    wanted = f"{TREE_ENV}={marker}".encode()
    found = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with (
                open(f"/proc/{name}/stat") as stat,
                open(f"/proc/{name}/environ", "rb") as environ,
                open(f"/proc/{name}/cmdline", "rb") as cmdline,
            ):
                fields, env, command = stat.read().rpartition(")")[2].split(), environ.read(), cmdline.read()
        except OSError:  # gone meanwhile, or another user's
            continue
        if fields[0] != "Z" and (int(fields[3]) == session or wanted in env.split(b"\0")):
            found[int(name)] = (fields[19], command.replace(b"\0", b" ").decode(errors="replace").strip())
    return found


def still_alive(processes: dict[int, tuple[str, str]], session: int, marker: str) -> dict[int, tuple[str, str]]:
    """Those of ``processes`` alive still (same pid, same start time), and any other process of the tree."""
    now = processes_of(session, marker)
    return {pid: info for pid, info in now.items() if pid not in processes or processes[pid][0] == info[0]}


@contextmanager
def running_train(words: list[str], env: dict) -> Iterator[tuple[subprocess.Popen, str]]:
    """``ppoflow train`` in a session of its own with a fresh marker; killed on the way out if it still runs."""
    marker = uuid.uuid4().hex
    process = subprocess.Popen(
        [*DEMO_TRAIN, *words],
        env={**env, TREE_ENV: marker},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        yield process, marker
    finally:
        process.kill()
        process.wait()


def wait_for(process: subprocess.Popen, marker: str, *patterns: str) -> dict[int, tuple[str, str]]:
    """The run's processes once one command line matches each of ``patterns`` (regular expressions)."""
    deadline = time.monotonic() + 300
    while True:
        tree = processes_of(process.pid, marker)
        if all(any(re.search(pattern, command) for _, command in tree.values()) for pattern in patterns):
            return tree
        assert process.poll() is None, f"the run ended first: {process.stderr.read().decode()[-3000:]}"
        assert time.monotonic() < deadline, f"not all of {patterns} started: {tree}"
        time.sleep(0.2)


def left_behind(
    processes: dict[int, tuple[str, str]], session: int, marker: str, staying: frozenset[int] = frozenset()
) -> dict[int, tuple[str, str]]:
    """What of the run is still alive once its processes had a generous while to stop (waiting no longer than
    until only those ``staying`` are left)."""
    deadline = time.monotonic() + 120
    while set(alive := still_alive(processes, session, marker)) - staying and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def own_run_env(tmp_path) -> dict:
    """An environment in which ``ppoflow train`` starts its own temporary Prefect server and its own Ray."""
    env = {name: value for name, value in os.environ.items() if name not in ("PREFECT_API_URL", "RAY_ADDRESS")}
    return {**env, "PREFECT_HOME": str(tmp_path / "prefect-home")}


def run_words(tiny_model: str, root, steps: int) -> list[str]:
    from tests.conftest import small_run

    return [
        w for w in small_run(tiny_model, root) if not w.startswith(("trainer.total", "trainer.test", "data.val"))
    ] + ["data.val_files=null", "trainer.test_freq=-1", f"trainer.total_training_steps={steps}"]


WATCHDOG = r"-m ppoflow\.flows\.reaper "
TEMPORARY_SERVER = r"uvicorn .*prefect\.server\.api\.server:create_app"


@pytest.mark.slow
@pytest.mark.reliability
def test_a_sigkilled_run_leaves_no_process_behind(tiny_model, tmp_path):
    with running_train(run_words(tiny_model, tmp_path, 50), own_run_env(tmp_path)) as (process, marker):
        tree = wait_for(
            process, marker, TEMPORARY_SERVER, "/gcs_server ", "/raylet ", "^ray::DashboardAgent", ACTOR, WATCHDOG
        )
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=60) == -signal.SIGKILL
        assert left_behind(tree, process.pid, marker) == {}


@pytest.mark.slow
@pytest.mark.reliability
def test_a_run_that_ends_leaves_no_process_behind(tiny_model, tmp_path):
    with running_train(run_words(tiny_model, tmp_path, 2), own_run_env(tmp_path)) as (process, marker):
        tree = wait_for(process, marker, TEMPORARY_SERVER, "/raylet ", ACTOR, WATCHDOG)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr.decode()[-3000:]
        assert left_behind(tree, process.pid, marker) == {}


@pytest.mark.slow
@pytest.mark.reliability
def test_a_sigkilled_run_leaves_the_ray_cluster_and_prefect_server_it_joined(
    prefect_server, ray_local, tiny_model, tmp_path
):
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    with running_train(run_words(tiny_model, tmp_path, 50), env) as (process, marker):
        tree = wait_for(process, marker, ACTOR, WATCHDOG)
        assert not any(re.search(TEMPORARY_SERVER, command) for _, command in tree.values())
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        assert left_behind(tree, process.pid, marker) == {}  # the run's actors too, which the cluster ran
        assert ray_local.get(ray_local.remote(num_cpus=0)(lambda: "still up").remote(), timeout=60) == "still up"
        with urllib.request.urlopen(f"{prefect_server}/health", timeout=10) as response:
            assert response.status == 200


@pytest.mark.slow
@pytest.mark.reliability
def test_a_run_cancelled_in_prefect_stops_and_leaves_no_process_behind(prefect_api, tiny_model, tmp_path):
    """Cancelling the flow run of ``ppoflow train`` as the UI does (state Cancelling) stops the process as
    SIGTERM does (exit 143, one line), records the run Cancelled, and leaves none of its processes."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.states import Cancelling

    experiment = f"cancel-{uuid.uuid4().hex[:8]}"
    words = run_words(tiny_model, tmp_path, 500) + [f"trainer.experiment_name={experiment}"]
    with running_train(words, {**os.environ, "PREFECT_API_URL": prefect_api}) as (process, marker):
        tree = wait_for(process, marker, ACTOR, WATCHDOG)
        with get_client(sync_client=True) as client:
            tagged = FlowRunFilter(tags=FlowRunFilterTags(all_=[f"experiment:{experiment}"]))
            deadline = time.monotonic() + 120
            while not (runs := client.read_flow_runs(flow_run_filter=tagged)) or not runs[0].state.is_running():
                assert time.monotonic() < deadline and process.poll() is None, "the flow run did not start"
                time.sleep(0.5)
            client.set_flow_run_state(runs[0].id, Cancelling(), force=True)
            _, stderr = process.communicate(timeout=300)
            assert process.returncode == 143, stderr.decode()[-3000:]
            assert "ppoflow: cancelled in Prefect" in stderr.decode()
            assert client.read_flow_run(runs[0].id).state.is_cancelled()
        assert left_behind(tree, process.pid, marker) == {}


@pytest.mark.slow  # ~11 s of grace periods, with the other process-tree tests
def test_the_watchdog_stops_what_carries_its_marker_and_spares_the_rest():
    """The watchdog on its own: once the process it watches is SIGKILLed, a marked child that ignores SIGTERM
    (SIGKILLed after the grace period) and a marked child in a session of its own are stopped, an unmarked one
    is spared, and the watchdog exits."""
    marker = uuid.uuid4().hex
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
    script = f"""
import os, subprocess, sys
from ppoflow.flows.reaper import MARKER_ENV, reap_on_exit
reap_on_exit()
quiet = {{"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}}  # the test reads this one's output to its end
marked = [subprocess.Popen([sys.executable, "-c", {stubborn!r}], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL),
          subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True, **quiet)]
spared = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **quiet,
                          env={{name: value for name, value in os.environ.items() if name != MARKER_ENV}})
marked[0].stdout.readline()  # SIGTERM is ignored from now on
print(spared.pid, *(process.pid for process in marked), flush=True)
os.kill(os.getpid(), 9)
"""
    trainer = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, TREE_ENV: marker},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trainer.returncode == -signal.SIGKILL, trainer.stderr
    spared, *marked = map(int, trainer.stdout.split())
    try:
        left = left_behind({}, -1, marker, staying=frozenset({spared}))
        assert set(left) == {spared}, left
    finally:
        os.kill(spared, signal.SIGKILL)
