"""The session's server processes (``ppoflow server`` for Prefect, ``mlflow server``), startable before they are
needed.

Each takes seconds to boot, mostly one process importing and migrating its SQLite database. When pytest
runs its default test paths, conftest starts both as it configures, so that they boot during collection (one
core) instead of in the first test that needs them; a fixture then adopts the early process, or starts its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

EARLY: dict[str, Server] = {}
"""Servers started at configure time, by name, until a fixture adopts them (the rest stop at unconfigure)."""


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen
    log_path: Path
    log: IO[bytes] = field(repr=False)

    def wait_until_healthy(self, timeout_s: float = 180) -> None:
        """Return once ``<url>/health`` answers 200 (both servers have it); fail naming the log otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start; see {self.log_path}")
            time.sleep(0.25)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def _start(name: str, url: str, command: list[str], log_path: Path, env: dict[str, str] | None = None) -> Server:
    log = open(log_path, "wb")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Server(name, url, process, log_path, log)


def start_prefect_server(home: Path, port: int) -> Server:
    """``ppoflow server`` on 127.0.0.1:``port`` with its own PREFECT_HOME and no UI; its URL is the API's."""
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "false", "PREFECT_API_URL": url}
    command = [sys.executable, "-m", "ppoflow.flows.cli", "server", "--host", "127.0.0.1", "--port", str(port)]
    return _start("prefect server", url, command, home / "server.log", env)


def start_mlflow_server(root: Path, port: int) -> Server:
    """``mlflow server`` on 127.0.0.1:``port``: a SQLite backend and an artifact folder under ``root``."""
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "art")]
    # job execution (MLflow's GenAI jobs, nothing of tracking) starts more processes that compete with the tests
    # for memory and CPU (docs/trackers.md)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return _start("mlflow server", f"http://127.0.0.1:{port}", command, root / "server.log", env)


def adopt_or_start(name: str, start) -> Server:
    """The early server called ``name``, or a new one from ``start()``."""
    return EARLY.pop(name, None) or start()
