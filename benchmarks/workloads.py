"""What the benchmarks share: the workloads (the demo as shipped, and a larger model on longer sequences,
each built - model and data - into a scratch folder of the benchmark's own), and running ppoflow's own
training loop on one of them with or without Ray and Prefect."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

WORKLOADS = {
    "demo": [],  # grpo_tiny as shipped: 16 prompts x 8 samples, 3-token responses
    "larger": [
        "actor_rollout_ref.model.build.hidden_size=512",
        "actor_rollout_ref.model.build.intermediate_size=1024",
        "actor_rollout_ref.model.build.num_hidden_layers=4",
        "actor_rollout_ref.model.build.num_attention_heads=8",
        "data.max_prompt_length=16",
        "data.max_response_length=16",
        "data.synthetic.digits=8",
    ],
}


def start_local_ray() -> None:
    """A local Ray for a benchmark's runs (4 logical CPUs on any machine, no dashboard, the workers' logs
    off the console), with Prefect's per-task-run lines quieted."""
    import ray

    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def built_in(scratch: str, name: str, *, validation: bool = False) -> list[str]:
    """Overrides that build workload ``name``'s model and data files under ``scratch``: overriding a path
    asks for the preset's build recipe explicitly (``build.seed``, ``synthetic.seed``), or the missing
    files would be an error."""
    return [
        f"actor_rollout_ref.model.path={scratch}/{name}-model",
        "actor_rollout_ref.model.build.seed=0",
        f"data.train_files={scratch}/{name}-train.parquet",
        "data.synthetic.seed=0",
        f"data.val_files={scratch}/{name}-val.parquet" if validation else "data.val_files=null",
    ]


def ppoflow_steps(
    cfg,
    *,
    ray_workers: bool,
    prefect_tasks: bool,
    steps: int,
    after_step: Callable[[int], None] | None = None,
    stages_type=None,
) -> list[dict[str, float]]:
    """Each step's metrics over ``steps`` steps of ppoflow's loop on ``cfg``, its workers in Ray actors or
    in this process, its stages Prefect task runs (inside a flow) or plain functions; ``after_step`` is
    called with each finished step's number (to read CPU counters, say); ``stages_type`` replaces
    :class:`~ppoflow.flows.stages.Stages` (a benchmark's baseline)."""
    import dataclasses

    from prefect import flow

    from ppoflow.flows.logs import logs_to_prefect
    from ppoflow.flows.modes import make_trainer
    from ppoflow.flows.run import start_run
    from ppoflow.flows.stages import Stages
    from ppoflow.flows.state import TrainerState
    from ppoflow.flows.step import train_steps

    run = start_run(cfg, orchestrated=ray_workers)
    run = dataclasses.replace(
        run,
        stages=(stages_type or Stages)(
            run.workers, run.stages.caches, orchestrated=prefect_tasks, rollout=run.stages.rollout, tags=run.stages.tags
        ),
    )
    state = TrainerState(cfg, len(run.train_set))
    mode = make_trainer(run, state)

    def loop() -> list[dict[str, float]]:
        with logs_to_prefect():  # the logging ``ppoflow train`` runs with (no console line per task run)
            rows = []
            for step in train_steps(run, state, mode, range(1, steps + 1)):
                rows.append(dict(step.metrics))
                if after_step is not None:
                    after_step(step.step)
            return rows

    try:
        return flow(name="benchmark-steps")(loop)() if prefect_tasks else loop()
    finally:
        run.workers.shutdown()


def task_runs_alone(
    stage_names: list[str], *, steps: int, after_step: Callable[[int], None] | None = None
) -> list[dict[str, float]]:
    """Prefect's own share of a step: each step one task run per name in ``stage_names``, named and
    recorded as ppoflow's stage runs are (``<stage>[step=N]``, a :class:`~ppoflow.tasks.task_inputs.RecordedTask`
    without caching, under ``ppoflow train``'s logging) but doing nothing, inside a flow. Per step
    ``timing_s/step``; ``after_step`` as :func:`ppoflow_steps` takes it."""
    from prefect import flow
    from prefect.cache_policies import NO_CACHE

    from ppoflow.flows.logs import logs_to_prefect
    from ppoflow.tasks.task_inputs import recorded_task

    @recorded_task(name="no_op", cache_policy=NO_CACHE)
    def no_op(step: int) -> None:
        """Nothing: the task run around it is what is measured."""

    def loop() -> list[dict[str, float]]:
        with logs_to_prefect():
            rows = []
            for step in range(1, steps + 1):
                start = time.perf_counter()
                for name in stage_names:
                    no_op.named(f"{name}[step={step}]")(step)
                rows.append({"timing_s/step": time.perf_counter() - start})
                if after_step is not None:
                    after_step(step)
            return rows

    return flow(name="benchmark-task-runs")(loop)()


def progress_updates_alone(*, steps: int, after_step: Callable[[int], None] | None = None) -> list[dict[str, float]]:
    """What publishing the run's progress after every step would cost (what
    :data:`~ppoflow.flows.artifacts.PROGRESS_INTERVAL_S` saves): a flow that creates a progress artifact and
    updates it ``steps`` times, one request to the server each. Per step ``timing_s/step``;
    ``after_step`` as :func:`ppoflow_steps` takes it."""
    from prefect import flow
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    def loop() -> list[dict[str, float]]:
        progress, rows = create_progress_artifact(progress=0.0, key="benchmark-progress"), []
        for step in range(1, steps + 1):
            start = time.perf_counter()
            update_progress_artifact(artifact_id=progress, progress=100.0 * step / steps)
            rows.append({"timing_s/step": time.perf_counter() - start})
            if after_step is not None:
                after_step(step)
        return rows

    return flow(name="benchmark-progress")(loop)()


def task_run_names_of_last_flow_run() -> list[str]:
    """The names of the task runs the Prefect server recorded for the newest flow run (the recorder writes
    in batches, at least every second, so this waits for it first)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    time.sleep(3)
    with get_client(sync_client=True) as client:
        [last] = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        runs, names, page = FlowRunFilter(id=FlowRunFilterId(any_=[last.id])), [], 200
        while True:
            found = client.read_task_runs(flow_run_filter=runs, limit=page, offset=len(names))
            names += [task_run.name for task_run in found]
            if len(found) < page:
                return names


def timing_medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of every ``timing_s/<name>`` over the rows that report it, by ``<name>``."""
    names = sorted({name for row in rows for name in row if name.startswith("timing_s/")})
    return {name[len("timing_s/") :]: statistics.median(row[name] for row in rows if name in row) for name in names}


@contextmanager
def local_prefect_server(scratch: str, *, tuned: bool = True) -> Iterator[int]:
    """A ``prefect server start`` of the benchmark's own (SQLite under ``scratch``, 127.0.0.1, a free
    port) with ppoflow's :data:`~ppoflow.flows.cli.SERVER_ENV` (``tuned``, as ``ppoflow server`` starts one)
    or Prefect's defaults, the API of this process for the block; yields the server's pid, so that the
    CPU time it spends on the benchmark's task runs can be read (:func:`process_cpu_seconds`)."""
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ppoflow.flows.cli import SERVER_ENV

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {name: value for name, value in os.environ.items() if name not in SERVER_ENV and name != "PREFECT_API_URL"}
    env.update(
        {
            "PREFECT_HOME": f"{scratch}/prefect-home-{'tuned' if tuned else 'default'}",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **(SERVER_ENV if tuned else {}),
        }
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        import urllib.request

        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the benchmark's Prefect server on port {port} did not start") from None
                time.sleep(0.5)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield server.pid
            finally:
                APILogHandler().flush()  # the runs' last log lines, while the server still listens
    finally:
        server.terminate()
        server.wait(timeout=30)


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ray_worker_cpu_seconds() -> dict[int, float]:
    """CPU seconds so far of each Ray process named ``ray::<what>`` (actors, tasks and Ray's agents; idle
    pooled workers left out), by pid."""
    seconds = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                name = cmdline.read().split(b"\0", 1)[0]
            if name.startswith(b"ray::") and name != b"ray::IDLE":
                seconds[int(entry)] = process_cpu_seconds(int(entry))
        except OSError:  # the process ended meanwhile
            continue
    return seconds


class CpuMeter:
    """Where a step's CPU time goes: this process (the driver), Ray's worker processes (the actors, and
    Ray's agents) and, when it runs on this machine, the Prefect server. :meth:`mark` reads the counters;
    :meth:`per_step` divides what was spent between two marks by the steps between them."""

    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid

    def mark(self) -> dict:
        return {
            "driver": time.process_time(),
            "ray": ray_worker_cpu_seconds(),
            "server": process_cpu_seconds(self.server_pid) if self.server_pid else 0.0,
        }

    @staticmethod
    def per_step(start: dict, end: dict, steps: int) -> dict[str, float]:
        """CPU seconds per step as ``cpu_driver``, ``cpu_ray`` and ``cpu_server``."""
        ray = sum(seconds - start["ray"].get(pid, 0.0) for pid, seconds in end["ray"].items())
        return {
            "cpu_driver": (end["driver"] - start["driver"]) / steps,
            "cpu_ray": ray / steps,
            "cpu_server": (end["server"] - start["server"]) / steps,
        }
