"""``ppoflow server`` against itself: a real ``prefect server start`` on a free, non-default port, read back
through its HTTP API - the address the UI reaches its API at, and the settings the server runs with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from ppoflow.flows.cli import SERVER_ENV
from tests.conftest import free_port

pytestmark = pytest.mark.slow  # a Prefect server of its own (~16 s to start on 2 busy cores)


def read_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.load(response)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``ppoflow server --host 127.0.0.1 --port PORT`` started with a stale PREFECT_API_URL exported (another
    port, as after an earlier session); yields the port and what its ``/ui-settings`` and settings say."""
    port, stale = free_port(), free_port()
    env = {name: value for name, value in os.environ.items() if name not in SERVER_ENV}
    env.update(
        {
            "PREFECT_HOME": str(tmp_path_factory.mktemp("server-home")),
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_API_URL": f"http://127.0.0.1:{stale}/api",
        }
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "ppoflow.flows.cli", "server", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                settings = read_json(f"http://127.0.0.1:{port}/api/admin/settings")
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, "ppoflow server did not start"
                time.sleep(0.5)
        yield port, read_json(f"http://127.0.0.1:{port}/ui-settings"), settings
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_ui_reaches_the_api_at_the_address_the_server_serves_on(server):
    port, ui_settings, settings = server
    assert ui_settings["api_url"] == f"http://127.0.0.1:{port}/api"  # not the stale PREFECT_API_URL, nor 4200
    assert (settings["server"]["api"]["host"], settings["server"]["api"]["port"]) == ("127.0.0.1", port)


def test_the_server_records_task_runs_in_batches(server):
    """The task-run recorder writes state events in batches, as ``SERVER_ENV`` says."""
    recorder = server[2]["server"]["services"]["task_run_recorder"]
    assert (recorder["batch_size"], recorder["read_batch_size"], recorder["flush_interval"]) == (50, 50, 1.0)
