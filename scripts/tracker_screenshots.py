"""Screenshots of a short ppoflow run in MLflow's UI, each checked to show what it says it shows, and the dump
viewer's output for docs/trackers.md.

Starts ``mlflow server`` on 127.0.0.1 (SQLite, artifacts in a temp directory), trains the demo config for a few
steps logging to it (``trainer.logger=[mlflow]``, validation samples, rollout dumps), drives headless Chromium
(:class:`ui_screenshots.Chromium`) over the run's pages and saves ``mlflow_run.png``, ``mlflow_metrics.png``,
``mlflow_reward_curve.png`` and ``mlflow_val_samples.png``; then prints ``ppoflow dump show`` of the last step's
worst samples.

    scripts/tracker_screenshots.sh [OUT_DIR]        (default: docs/images/trackers)
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ui_screenshots import Chromium, answers, find_chromium, free_port

STEPS = 8
SETTLE_S = 4.0
"""How long a page is left to draw its charts and previews once what it must show is there."""
EXPERIMENT = "grpo_tiny"


def start_mlflow(root: Path) -> tuple[subprocess.Popen, str]:
    """``mlflow server`` on a free port of 127.0.0.1, SQLite backend and artifacts under ``root``; waits until
    it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "art")]
    log = open(root / "mlflow.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if answers(f"{url}/health", within_s=600):  # slow on a busy machine
        return server, url
    stop(server)
    raise SystemExit(f"mlflow server did not start; see {root / 'mlflow.log'}")


def stop(server: subprocess.Popen) -> None:
    """Stop the MLflow server and the job workers it started (its process group)."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def train(root: Path, mlflow: str) -> None:
    """The demo config for :data:`STEPS` steps in this process, logging to ``mlflow``."""
    from ppoflow.configs import load_config
    from ppoflow.flows.train import train as run

    # a busy machine's server answers slowly: wait for it (ppoflow's defaults give up after 10 s, once)
    os.environ.update(MLFLOW_HTTP_REQUEST_TIMEOUT="120", MLFLOW_HTTP_REQUEST_MAX_RETRIES="3")

    words = [
        f"trainer.default_local_dir={root}/run",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=4",
        "trainer.logger=[mlflow]",
        f"trainer.mlflow_tracking_uri={mlflow}",
        f"trainer.experiment_name={EXPERIMENT}",
        "trainer.log_val_generations=4",
        f"trainer.rollout_data_dir={root}/rollouts",
    ]
    run(load_config("grpo_tiny", words), orchestrated=False)


@dataclass(frozen=True)
class Page:
    """A page of the run to capture: its address, what to do there first (``search`` the metric charts for a
    text, or ``select`` an artifact), the text the page must then show, and the window height."""

    address: str
    shows: str
    search: str | None = None
    select: str | None = None
    height: int = 1000


def pages(mlflow: str) -> dict[str, Page]:
    """The run's pages in MLflow's UI (found through its client)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow)
    experiment = client.get_experiment_by_name("ppoflow")
    (run,) = client.search_runs([experiment.experiment_id])
    run_page = f"{mlflow}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
    return {
        "mlflow_run": Page(run_page, "data/train_batch_size"),
        "mlflow_metrics": Page(f"{run_page}/model-metrics", "critic/score/mean", search="critic/score"),
        "mlflow_reward_curve": Page(f"{run_page}/artifacts", "Path: mlflow-artifacts:", select="reward_curve.png"),
        "mlflow_val_samples": Page(f"{run_page}/artifacts", '"input"', select=f"val_step{STEPS}.json"),
    }


LOCAL_STORAGE = {
    "mlflow.workflowType_v1": '"machine_learning"',
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
    "mlflow.assistant.panelOpen_v1": "false",
}
"""The UI's settings for the pictures: its "Model training" views, the assistant's panel closed."""


def capture(browser: Chromium, page: Page, out: Path) -> None:
    """Open ``page``, act, wait until the page's text holds ``page.shows``, let it settle, save a PNG."""
    browser.open(page.address, page.height)
    if page.search is not None:
        search = "document.querySelector('input[placeholder=\"Search metric charts\"]')"
        browser.wait_for(f"{search} !== null", "the metric charts' search box")
        browser.evaluate(f"{search}.focus()")
        browser.call("Input.insertText", text=page.search)
    if page.select is not None:
        item = f"[...document.querySelectorAll('li')].find(item => item.textContent.trim() === {page.select!r})"
        box = f"{item}?.getBoundingClientRect()"
        x, y = browser.wait_for(
            f"(() => {{ const box = {box}; return box && [box.x + 20, box.y + box.height / 2]; }})()",
            f"the artifact {page.select}",
        )
        for kind in ("mousePressed", "mouseReleased"):
            browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    browser.wait_for(f"document.body.innerText.includes({page.shows!r})", repr(page.shows))
    time.sleep(SETTLE_S)
    out.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="docs/images/trackers")
    args = parser.parse_args()
    chromium = find_chromium()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        server, mlflow = start_mlflow(root)
        browser = None
        try:
            os.chdir(root)  # the demo builds its model and data under ./outputs
            train(root, mlflow)
            browser = Chromium(chromium, root / "chromium")
            browser.open(mlflow, 1000)
            browser.wait_for("document.readyState === 'complete'", "MLflow's page")
            for key, value in LOCAL_STORAGE.items():
                browser.evaluate(f"localStorage.setItem({key!r}, {value!r})")
            for name, page in pages(mlflow).items():
                capture(browser, page, out / f"{name}.png")
                print(f"{out / name}.png  <- {page.address} (shows {page.shows!r})")
        finally:
            if browser is not None:
                browser.close()
            stop(server)
        from ppoflow.flows.cli import main as ppoflow

        print(f"$ ppoflow dump show {root}/rollouts --step {STEPS} --worst 2")
        ppoflow(["dump", "show", str(root / "rollouts"), "--step", str(STEPS), "--worst", "2"])


if __name__ == "__main__":
    main()
