"""Screenshots of the Prefect UI showing a short ppoflow run, each checked to show what it says it shows.

Starts ``ppoflow server`` with a PREFECT_HOME of its own, trains 4 steps that dump their rollouts, replays them,
registers the deployments, and drives headless Chromium over its DevTools protocol: each page's tab is selected,
checked, then saved as ``run.png``, ``task_runs.png``, ``cached.png``, ``task_inputs.png``, ``artifacts.png`` and
``deployment.png``. It also prints the Task Runs tab's time to rows; ``--time-to-rows URL`` only measures that.
Details: docs/ui.md.

    scripts/ui_screenshots.sh [OUT_DIR]        (default: docs/images/ui)
    scripts/ui_screenshots.sh --time-to-rows http://127.0.0.1:4200/runs/flow-run/<id> [--repeat 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
WIDTH = 1440
PAGE_TIMEOUT_S = 120
SETTLE_S = 2.0
"""How long a page is left to finish drawing (fonts, charts) once what it must show is there."""
TASK_RUN_ROW = ".task-run-list-item"
FIRST_ROW_OBSERVER = f"""
new MutationObserver((changes, observer) => {{
  if (document.querySelector('{TASK_RUN_ROW}')) {{ window.firstRowAt = performance.now(); observer.disconnect(); }}
}}).observe(document, {{childList: true, subtree: true}});
"""
"""Runs in every page before its own scripts: notes when the first task-run row is in the DOM, in ms since
the navigation started (``performance.now``), so polling the page cannot delay the figure."""


@dataclass(frozen=True)
class Shot:
    """A page to capture: its address, the tab that must be the selected one (None: a page without tabs),
    a CSS selector that must match in the page, and the window height."""

    address: str
    tab: str | None
    shows: str
    height: int = 1000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Chromium:
    """Headless Chromium, one page, driven over the DevTools protocol (a WebSocket, no driver)."""

    def __init__(self, executable: str, profile: Path):
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={WIDTH},1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{executable} did not start its DevTools endpoint")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as listing:
            page = next(target for target in json.load(listing) if target["type"] == "page")
        self.socket = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.calls = 0
        self.call("Page.enable")
        self.call("Page.addScriptToEvaluateOnNewDocument", source=FIRST_ROW_OBSERVER)

    def call(self, method: str, **params) -> dict:
        """One DevTools command; its result (events arriving meanwhile are dropped)."""
        self.calls += 1
        self.socket.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=PAGE_TIMEOUT_S))
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, what: str):
        """The value of ``expression`` once it is truthy, polled; stops the script naming ``what`` otherwise."""
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.evaluate('location.href')}: {what} did not appear in {PAGE_TIMEOUT_S} s")
            time.sleep(0.05)
        return value

    def open(self, address: str, height: int) -> None:
        """Navigate to ``address`` from a blank page (so nothing read next is the previous page's)."""
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url="about:blank")
        self.wait_for("location.href === 'about:blank'", "a blank page")
        self.call("Page.navigate", url=address)

    def selected_tab(self) -> str | None:
        return self.evaluate("document.querySelector('li.p-tab.p-tab__active')?.textContent.trim() ?? null")

    def select_tab(self, tab: str) -> None:
        """Click ``tab`` once the page shows its tabs: the flow run page drops a ``?tab=`` it was opened with
        while the run is loading (the tab is hidden until then) and shows Logs."""
        self.wait_for(
            f"[...document.querySelectorAll('li.p-tab')].some(t => t.textContent.trim() === {tab!r})", f"the {tab} tab"
        )
        if self.selected_tab() != tab:
            self.evaluate(
                f"[...document.querySelectorAll('li.p-tab')].find(t => t.textContent.trim() === {tab!r}).click()"
            )

    def capture(self, shot: Shot, out: Path) -> None:
        """Open ``shot``, select its tab, check that the page shows the tab and what it must, save a PNG."""
        self.open(shot.address, shot.height)
        if shot.tab is not None:
            self.select_tab(shot.tab)
        self.wait_for(f"document.querySelector({shot.shows!r}) !== null", f"{shot.shows!r}")
        time.sleep(SETTLE_S)
        selected = self.selected_tab()
        if selected != shot.tab:
            raise SystemExit(f"{out.name}: {shot.address} shows the {selected or 'no'} tab, not {shot.tab or 'none'}")
        out.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def time_to_rows(self, flow_run_page: str) -> tuple[float, float]:
        """Seconds from navigating to a flow run page until its Task Runs tab shows a task-run row, and from
        clicking that tab (as soon as it shows) until then."""
        self.open(flow_run_page, 1000)
        self.select_tab("Task Runs")
        clicked = self.evaluate("performance.now()")
        first_row = self.wait_for("window.firstRowAt", "a task-run row")
        return first_row / 1000, (first_row - clicked) / 1000

    def close(self) -> None:
        self.socket.close()
        self.process.terminate()
        self.process.wait(timeout=30)


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    """``ppoflow server`` (``prefect server start`` with ppoflow's settings) on a free port with the UI; waits
    until it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_API_URL": f"{url}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "ppoflow.flows.cli", "server", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    if answers(f"{url}/api/health", within_s=120):
        return server, url
    server.terminate()
    raise SystemExit(f"prefect server did not start; see {home / 'server.log'}")


def answers(url: str, *, within_s: float) -> bool:
    """Whether ``url`` answers a GET within ``within_s`` seconds (asked every half second)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except OSError:
            time.sleep(0.5)
    return False


def train(root: Path, name: str, extra: list[str]) -> str:
    """One short run of the demo config (its model and data built under the current directory) from this
    process; returns its flow run id."""
    from ppoflow.flows.train import ppo_train

    words = [
        f"trainer.default_local_dir={root}/{name}",
        "trainer.total_training_steps=4",
        "trainer.test_freq=2",
        "trainer.save_freq=2",
        "trainer.logger=[]",
        "skip.rollout.enable=true",
        f"skip.rollout.dump_dir={root}/cache",
        "skip.rollout.steps=[1,2,3,4]",
        *extra,
    ]
    state = ppo_train(config="grpo_tiny", overrides=words, experiment_name="ui_demo", return_state=True)
    if not state.is_completed():
        raise SystemExit(f"the {name} run did not complete: {state}")
    return str(state.state_details.flow_run_id)


def shots(url: str, first_run: str, replay_run: str) -> dict[str, Shot]:
    """The UI pages to capture, found through the API, with what each must show."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterId,
    )

    time.sleep(3)  # task runs and artifacts reach the server as events
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[replay_run])), limit=200)
        cached = next(task for task in tasks if task.name == "generate[step=2]")
        summary = next(
            artifact
            for artifact in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[first_run]))
            )
            if artifact.key.endswith("-summary")
        )
        (deployment,) = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["ppo-train"]))
        )
    return {
        "run": Shot(f"{url}/runs/flow-run/{replay_run}", "Logs", ".flow-run-graph"),
        "task_runs": Shot(f"{url}/runs/flow-run/{replay_run}?tab=Task+Runs", "Task Runs", TASK_RUN_ROW),
        "cached": Shot(f"{url}/runs/task-run/{cached.id}", "Logs", ".log-row"),
        "task_inputs": Shot(
            f"{url}/runs/task-run/{cached.id}?tab=Task+inputs", "Task inputs", "#task-inputs-content .p-code-highlight"
        ),
        "artifacts": Shot(f"{url}/artifacts/artifact/{summary.id}", None, ".artifact-data-markdown img", 1600),
        "deployment": Shot(f"{url}/deployments/deployment/{deployment.id}/run", None, "form"),
    }


def find_chromium() -> str:
    chromium = next((shutil.which(name) for name in CHROMIUM_NAMES if shutil.which(name)), None)
    if chromium is None:
        raise SystemExit("no Chromium found: install the distribution's package (apt-get install chromium)")
    return chromium


def report_time_to_rows(browser: Chromium, flow_run_page: str, repeat: int) -> None:
    """Print the Task Runs tab's time to rows, each try and the median, with the machine's load."""
    tries = [browser.time_to_rows(flow_run_page) for _ in range(repeat)]
    for loaded, clicked in tries:
        print(f"time to rows: {loaded:.2f} s from navigation, {clicked:.2f} s from the tab's click")
    print(
        f"median of {repeat}: {statistics.median(t[0] for t in tries):.2f} s from navigation, "
        f"{statistics.median(t[1] for t in tries):.2f} s from the click; "
        f"load average {Path('/proc/loadavg').read_text().split()[0]} ({flow_run_page})"
    )


def photograph(browser: Chromium, out: Path, root: Path) -> None:
    """Train, replay, serve, then capture every page of :func:`shots` into ``out``."""
    server, url = start_server(root / "home")
    serving = None
    try:
        os.environ.update({"PREFECT_API_URL": f"{url}/api", "PREFECT_HOME": str(root / "home")})
        os.chdir(root)  # the demo builds its model and data under ./outputs
        first = train(root, "first", [])
        replay = train(root, "replay", [])
        serving = subprocess.Popen(
            [sys.executable, "-m", "ppoflow.flows.cli", "serve", "--replay-dir", str(root / "first")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                pages = shots(url, first, replay)
                break
            except (StopIteration, ValueError):
                if time.monotonic() > deadline:
                    raise
        for name, shot in pages.items():
            browser.capture(shot, out / f"{name}.png")
            print(f"{out / name}.png  <- {shot.address} ({shot.tab or 'no'} tab, {shot.shows})")
        report_time_to_rows(browser, pages["run"].address, 1)
    finally:
        if serving is not None:
            serving.terminate()
            serving.wait(timeout=30)
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="docs/images/ui")
    parser.add_argument(
        "--time-to-rows",
        metavar="FLOW_RUN_PAGE",
        help="only measure the Task Runs tab of this flow run page (a server already running)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="tries of --time-to-rows (default 3)")
    args = parser.parse_args()
    chromium = find_chromium()
    out = Path(args.out).resolve()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        (root / "home").mkdir()
        browser = Chromium(chromium, root / "chromium")
        try:
            if args.time_to_rows:
                report_time_to_rows(browser, args.time_to_rows, args.repeat)
            else:
                out.mkdir(parents=True, exist_ok=True)
                photograph(browser, out, root)
        finally:
            browser.close()


if __name__ == "__main__":
    main()
