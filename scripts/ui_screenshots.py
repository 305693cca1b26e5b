"""Screenshots of the Prefect UI showing a short ppoflow run: what a user sees, checked by eye.

Starts ``ppoflow server`` (UI on) with a PREFECT_HOME of its own, trains 4 steps that dump their
rollouts, replays them in a second run (cache hits), registers the deployments, and saves with headless
Chromium (the distribution's package: ``apt-get install chromium``)::

    run.png         the replay's flow run page (timeline, task runs, logs)
    task_runs.png   its task runs list, named and tagged by stage and step
    cached.png      a replayed generate task run: Cached, its cache key, the entry it loaded
    task_inputs.png a generate task run's inputs: where its prompts came from, its step and settings
    artifacts.png   the first run's summary artifact
    deployment.png  the ppo-train deployment's run form

    scripts/ui_screenshots.sh [OUT_DIR]        (default: docs/images/ui)
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    """``ppoflow server`` (``prefect server start`` with ppoflow's settings) on a free port with the UI; waits
    until it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "true", "PREFECT_API_URL": f"{url}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = open(home / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "ppoflow.flows.cli", "server", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/api/health", timeout=2):
                return server, url
        except OSError:
            time.sleep(0.5)
    server.terminate()
    raise SystemExit(f"prefect server did not start; see {home / 'server.log'}")


def train(root: Path, name: str, extra: list[str]) -> str:
    """One short run of the demo config (its model and data built under the current directory) from this
    process; returns its flow run id."""
    from ppoflow.flows.train import ppo_train

    words = [f"trainer.default_local_dir={root}/{name}", "trainer.total_training_steps=4", "trainer.test_freq=2", "trainer.save_freq=2", "trainer.logger=[]",
             "skip.rollout.enable=true", f"skip.rollout.dump_dir={root}/cache", "skip.rollout.steps=[1,2,3,4]",
             *extra]
    state = ppo_train(config="grpo_tiny", overrides=words, experiment_name="ui_demo", return_state=True)
    if not state.is_completed():
        raise SystemExit(f"the {name} run did not complete: {state}")
    return str(state.state_details.flow_run_id)


def pages(url: str, first_run: str, replay_run: str) -> dict[str, str]:
    """The UI addresses to capture, found through the API."""
    from prefect import get_client
    from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, DeploymentFilter,
                                                DeploymentFilterName, FlowRunFilter, FlowRunFilterId)

    time.sleep(3)  # task runs and artifacts reach the server as events
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[replay_run])), limit=200)
        cached = next(task for task in tasks if task.name == "generate[step=2]")
        summary = next(artifact for artifact in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[first_run]))) if artifact.key.endswith("-summary"))
        (deployment,) = client.read_deployments(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=["ppo-train"])))
    return {"run": f"{url}/runs/flow-run/{replay_run}",
            "task_runs": f"{url}/runs/flow-run/{replay_run}?tab=Task+Runs",
            "cached": f"{url}/runs/task-run/{cached.id}",
            "task_inputs": f"{url}/runs/task-run/{cached.id}?tab=Task+Inputs",
            "artifacts": f"{url}/artifacts/artifact/{summary.id}",
            "deployment": f"{url}/deployments/deployment/{deployment.id}/run"}


def screenshot(chromium: str, address: str, out: Path, height: int) -> None:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1440,{height}", "--run-all-compositor-stages-before-draw",
                    "--virtual-time-budget=30000", f"--screenshot={out}", address],
                   check=True, capture_output=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="docs/images/ui")
    args = parser.parse_args()
    chromium = next((shutil.which(name) for name in CHROMIUM_NAMES if shutil.which(name)), None)
    if chromium is None:
        raise SystemExit("no Chromium found: install the distribution's package (apt-get install chromium)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "home").mkdir()
        server, url = start_server(root / "home")
        serving = None
        try:
            os.environ.update({"PREFECT_API_URL": f"{url}/api", "PREFECT_HOME": str(root / "home")})
            os.chdir(root)  # the demo builds its model and data under ./outputs
            first = train(root, "first", [])
            replay = train(root, "replay", [])
            serving = subprocess.Popen([sys.executable, "-m", "ppoflow.flows.cli", "serve", "--replay-dir",
                                        str(root / "first")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + 60
            while True:
                try:
                    addresses = pages(url, first, replay)
                    break
                except (StopIteration, ValueError):
                    if time.monotonic() > deadline:
                        raise
            for name, address in addresses.items():
                screenshot(chromium, address, out / f"{name}.png", 1600 if name == "artifacts" else 1000)
                print(f"{out / name}.png  <- {address}")
        finally:
            if serving is not None:
                serving.terminate()
                serving.wait(timeout=30)
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
