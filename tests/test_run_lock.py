"""A run directory is owned by one run at a time (``storage/run_lock.py``, ``flows/ownership.py``): a second
run is refused naming the owner, or waits; of simultaneous claims exactly one wins, locally and on S3 (the
moto server); a lock whose owner was SIGKILLed, whose foreign host stopped its heartbeat, or that is not an
owner record at all is taken over with a warning; the lock goes however the run ends."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.ownership import own_run_directory
from ppoflow.flows.train import train
from ppoflow.storage import run_lock
from ppoflow.storage.run_lock import LOCK_FILE, Owner, RunDirectoryBusy, claim
from tests.conftest import S3_TEST_BUCKET

pytestmark = pytest.mark.reliability

HOLDER = """
import sys, time
from ppoflow.storage.run_lock import claim
lock = claim(sys.argv[1])
print(lock.owner.token, flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that claims a run directory and keeps it; yields (its Popen, the directory)."""
    run_dir = str(tmp_path / "run")
    process = subprocess.Popen([sys.executable, "-c", HOLDER, run_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip(), "the holder did not claim the directory"
        yield process, run_dir
    finally:
        process.kill()
        process.wait()


def lock_record(run_dir: str) -> dict:
    return json.loads(Path(run_dir, LOCK_FILE).read_bytes())


def config(run_dir: str, *words: str):
    return load_config("grpo_tiny", [f"trainer.default_local_dir={run_dir}", *words])


# --- two owners ---------------------------------------------------------------------------------


def test_a_second_claim_on_a_local_directory_is_refused_naming_the_owner(tmp_path):
    run_dir = str(tmp_path / "run")
    with claim(run_dir, flow_run_id="1234", flow_run_name="brave-otter") as first:
        with pytest.raises(RunDirectoryBusy) as busy:
            claim(run_dir)
        assert busy.value.owner == first.owner
        message = str(busy.value)
        assert run_dir in message and f"pid {os.getpid()}" in message and first.owner.host in message
        assert "flow run 'brave-otter' (1234)" in message and "started 20" in message
    assert not Path(run_dir, LOCK_FILE).exists()
    claim(run_dir).release()  # free again


def test_a_second_claim_on_an_s3_directory_is_refused_naming_the_owner(s3_server):
    _, options = s3_server
    run_dir = f"s3://{S3_TEST_BUCKET}/{uuid.uuid4().hex}/run"
    with claim(run_dir, storage_options=options) as first:
        with pytest.raises(RunDirectoryBusy) as busy:
            claim(run_dir, storage_options=options)
        assert busy.value.owner == first.owner and run_dir in str(busy.value)
    with claim(run_dir, storage_options=options) as second:  # released: free again
        assert second.owner.token != first.owner.token


def race(run_dir: str, options: dict | None, claims: int) -> tuple[list, list[RunDirectoryBusy]]:
    """``claims`` threads claim ``run_dir`` at the same instant: the locks won and the refusals."""
    start = threading.Barrier(claims)
    won, refused = [], []

    def contend():
        start.wait()
        try:
            won.append(claim(run_dir, storage_options=options))
        except RunDirectoryBusy as busy:
            refused.append(busy)

    threads = [threading.Thread(target=contend) for _ in range(claims)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won, refused


@pytest.mark.parametrize("where", ["local", "s3"])
def test_of_simultaneous_claims_exactly_one_wins(where, tmp_path, request):
    options = request.getfixturevalue("s3_server")[1] if where == "s3" else None
    run_dir = f"s3://{S3_TEST_BUCKET}/{uuid.uuid4().hex}/run" if where == "s3" else str(tmp_path / "run")
    claims = 8
    won, refused = race(run_dir, options, claims)
    assert len(won) == 1 and len(refused) == claims - 1
    assert {busy.owner.token for busy in refused} == {won[0].owner.token}
    won[0].release()


# --- waiting --------------------------------------------------------------------------------------


def test_a_waiting_run_proceeds_once_the_owner_releases(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    first = claim(run_dir)
    second_owned = threading.Event()

    def second_run():
        with own_run_directory(config(run_dir, "trainer.run_dir_busy=wait"), poll_s=0.05):
            second_owned.set()

    waiting = threading.Thread(target=second_run)
    waiting.start()
    try:
        for _ in range(200):
            if "waiting for it to end" in caplog.text:
                break
            time.sleep(0.05)
        assert "waiting for it to end (trainer.run_dir_busy=wait)" in caplog.text
        assert not second_owned.is_set() and lock_record(run_dir)["token"] == first.owner.token
    finally:
        first.release()
    waiting.join(timeout=60)
    assert second_owned.is_set()
    assert not Path(run_dir, LOCK_FILE).exists()  # the second run released it in turn


def test_a_waiting_run_gives_up_after_run_dir_wait_s(tmp_path):
    run_dir = str(tmp_path / "run")
    with claim(run_dir):
        with pytest.raises(ConfigError) as raised:
            with own_run_directory(
                config(run_dir, "trainer.run_dir_busy=wait", "trainer.run_dir_wait_s=0.2"), poll_s=0.05
            ):
                pytest.fail("the directory is owned")
    ((key, message),) = raised.value.problems
    assert key == "trainer.default_local_dir"
    assert run_dir in message and "still after waiting trainer.run_dir_wait_s=0.2 s" in message


def test_a_busy_directory_fails_by_default_naming_the_key_and_the_way_out(tmp_path):
    run_dir = str(tmp_path / "run")
    with claim(run_dir), pytest.raises(ConfigError) as raised:
        with own_run_directory(config(run_dir)):
            pytest.fail("the directory is owned")
    ((key, message),) = raised.value.problems
    assert key == "trainer.default_local_dir" and f"pid {os.getpid()}" in message
    assert "trainer.run_dir_busy=wait" in message


# --- stale locks ----------------------------------------------------------------------------------


def test_the_lock_of_a_sigkilled_run_is_taken_over_with_a_warning(holder, caplog):
    process, run_dir = holder
    assert lock_record(run_dir)["pid"] == process.pid
    with pytest.raises(RunDirectoryBusy, match=f"pid {process.pid}"):
        claim(run_dir)  # alive: refused
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    with own_run_directory(config(run_dir)) as lock:  # the successor takes over
        assert lock_record(run_dir)["token"] == lock.owner.token
    assert f"taking over the lock of run directory {run_dir}: pid {process.pid}" in caplog.text
    assert f"pid {process.pid} is not running" in caplog.text


def test_a_lock_whose_pid_now_runs_another_process_is_stale(tmp_path, caplog):
    """A reused pid: this very process, but not the one that took the lock (another start time)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reused = Owner.this_process()
    (run_dir / LOCK_FILE).write_bytes(Owner(**{**reused.__dict__, "process_start": "1"}).encode())
    claim(str(run_dir)).release()
    assert f"pid {os.getpid()} is another process now (a reused pid)" in caplog.text


def foreign_lock(run_dir: Path, heartbeat_age_s: float) -> Owner:
    run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    owner = Owner(
        uuid.uuid4().hex,
        "another-host.example",
        "boot pid:[1]",
        4242,
        "100",
        now - 3600,
        now - heartbeat_age_s,
        None,
        None,
    )
    (run_dir / LOCK_FILE).write_bytes(owner.encode())
    return owner


def test_a_foreign_host_with_a_fresh_heartbeat_keeps_the_lock(tmp_path):
    owner = foreign_lock(tmp_path / "run", heartbeat_age_s=1)
    with pytest.raises(RunDirectoryBusy) as busy:
        claim(str(tmp_path / "run"))  # its pid is nothing here: only the heartbeat counts
    assert busy.value.owner == owner and "pid 4242 on host 'another-host.example'" in str(busy.value)


def test_a_foreign_host_whose_heartbeat_stopped_loses_the_lock(tmp_path, caplog):
    foreign_lock(tmp_path / "run", heartbeat_age_s=run_lock.STALE_AFTER_S + 5)
    with claim(str(tmp_path / "run")) as lock:
        assert lock_record(str(tmp_path / "run"))["token"] == lock.owner.token
    assert "another-host.example" in caplog.text and "its heartbeat is" in caplog.text


def test_the_heartbeat_is_refreshed_while_the_run_lives(tmp_path):
    run_dir = str(tmp_path / "run")
    with claim(run_dir, heartbeat_s=0.05) as lock:
        first = lock_record(run_dir)["heartbeat"]
        for _ in range(200):
            if lock_record(run_dir)["heartbeat"] > first:
                break
            time.sleep(0.05)
        assert lock_record(run_dir)["heartbeat"] > first
        assert lock_record(run_dir)["token"] == lock.owner.token


RECORD = json.loads(Owner.this_process().encode())
GARBAGE = {
    "not JSON": b"{",
    "empty (killed before writing)": b"",
    "a pickle": pickle.dumps({"pid": 1, "host": "x"}),
    "a list": b"[]",
    "an extra key": json.dumps({**RECORD, "extra": 1}).encode(),
    "pid is a string": json.dumps({**RECORD, "pid": "1"}).encode(),
    "heartbeat is infinite": json.dumps({**RECORD, "heartbeat": float("inf")}).encode(),
    "another format_version": json.dumps({**RECORD, "format_version": 2}).encode(),
    "nested too deeply": b"[" * 60_000,
    "too big": b" " * (run_lock.MAX_LOCK_BYTES + 1),
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_a_garbage_lock_file_is_taken_over_with_a_warning(tmp_path, caplog, garbage):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_bytes(garbage)
    with claim(str(run_dir)) as lock:
        assert lock_record(str(run_dir))["token"] == lock.owner.token
    assert "unreadable lock file (it is not an owner record" in caplog.text


def test_a_stale_s3_lock_is_taken_over_by_exactly_one_of_its_successors(s3_server, caplog):
    _, options = s3_server
    import s3fs

    run_dir = f"s3://{S3_TEST_BUCKET}/{uuid.uuid4().hex}/run"
    s3fs.S3FileSystem(skip_instance_cache=True, **options).pipe_file(f"{run_dir}/{LOCK_FILE}", b"garbage")
    won, refused = race(run_dir, options, 4)
    assert len(won) == 1 and len(refused) == 3
    won[0].release()


def test_inside_a_prefect_flow_run_the_lock_names_it(prefect_api, tmp_path):
    from prefect import flow

    run_dir = str(tmp_path / "run")

    @flow(name="hold-run-dir")
    def hold() -> dict:
        with own_run_directory(config(run_dir)):
            return lock_record(run_dir)

    state = hold(return_state=True)
    record = state.result()
    assert record["flow_run_id"] == str(state.state_details.flow_run_id) and record["flow_run_name"]
    assert record["pid"] == os.getpid() and not Path(run_dir, LOCK_FILE).exists()


# --- released however the run ends ----------------------------------------------------------------


@pytest.mark.parametrize("ending", [ValueError, KeyboardInterrupt])
def test_the_lock_is_released_when_the_run_fails_or_is_interrupted(tmp_path, ending):
    run_dir = str(tmp_path / "run")
    with pytest.raises(ending):
        with own_run_directory(config(run_dir)):
            assert Path(run_dir, LOCK_FILE).exists()
            raise ending()
    assert not Path(run_dir, LOCK_FILE).exists()


def test_a_run_on_a_directory_owned_by_a_live_process_is_refused_before_any_worker_starts(
    holder, tiny_overrides, tmp_path
):
    process, run_dir = holder
    cfg = load_config("grpo_tiny", tiny_overrides)
    assert cfg.trainer.default_local_dir == run_dir
    with pytest.raises(ConfigError) as raised:
        train(cfg, orchestrated=False)
    ((key, message),) = raised.value.problems
    assert key == "trainer.default_local_dir" and f"pid {process.pid}" in message
    assert not (tmp_path / "data").exists()  # start_run builds the synthetic data first: it never ran
    assert sorted(os.listdir(run_dir)) == [LOCK_FILE]
