"""Shared pytest fixtures: real servers (S3 via moto, Prefect), a local Ray, and a tiny model.

Every server binds to 127.0.0.1 on a free port and is stopped when the session ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from tests.servers import EARLY, adopt_or_start, start_mlflow_server, start_prefect_server

TEST_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
os.environ.update(TEST_ENV)


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    """Models fetched from fsspec URLs are copied here, not into the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("PPOFLOW_MODEL_CACHE", str(tmp_path_factory.mktemp("model-cache")))
        yield


# --- the reliability suite's summary -----------------------------------------------------------

RELIABILITY: dict[str, str] = {}
"""Outcome of every test marked ``reliability`` in this session, by test id."""


def pytest_runtest_logreport(report):
    if "reliability" in report.keywords and (report.when == "call" or report.outcome != "passed"):
        if report.outcome != "passed" or report.nodeid not in RELIABILITY:
            RELIABILITY[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter):
    """One line: how many reliability cases were tried and how many were handled well (and which were not)."""
    if RELIABILITY:
        handled = sum(outcome == "passed" for outcome in RELIABILITY.values())
        terminalreporter.write_line(f"reliability suite: {len(RELIABILITY)} cases tried, {handled} handled well")
        for nodeid, outcome in sorted(RELIABILITY.items()):
            if outcome != "passed":
                terminalreporter.write_line(f"  not handled well ({outcome}): {nodeid}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- s3_server: an in-process S3 (moto server mode) for fsspec/s3fs tests ----------------------
# Self-contained: it needs nothing else from this file. Server mode (a real HTTP endpoint) rather
# than moto's in-process mock, so that subprocesses and Ray workers can reach the same buckets.

S3_TEST_BUCKET = "ppoflow-test"


@pytest.fixture(scope="session")
def s3_server():
    """Start moto's S3 server for the session and yield ``(endpoint_url, storage_options)``.

    The bucket ``ppoflow-test`` exists; ``storage_options`` are s3fs options (dummy credentials,
    the endpoint). The AWS_* environment variables are set for the session too, so subprocesses
    and boto clients find the same dummy credentials. Tests sharing the server should write
    under a prefix of their own.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint_url = f"http://127.0.0.1:{port}"
    credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    try:
        with pytest.MonkeyPatch.context() as environment:
            environment.setenv("AWS_ACCESS_KEY_ID", credentials["aws_access_key_id"])
            environment.setenv("AWS_SECRET_ACCESS_KEY", credentials["aws_secret_access_key"])
            environment.setenv("AWS_DEFAULT_REGION", "us-east-1")
            environment.setenv("AWS_REGION", "us-east-1")
            s3 = boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1", **credentials)
            s3.create_bucket(Bucket=S3_TEST_BUCKET)
            storage_options = {
                "key": credentials["aws_access_key_id"],
                "secret": credentials["aws_secret_access_key"],
                "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
            }
            yield endpoint_url, storage_options
    finally:
        server.stop()


# --- early servers: Prefect and MLflow boot during collection (tests/servers.py) ----------------------


EARLY_ROOT = pytest.StashKey[Path]()
"""The temporary folder of the early servers' homes, removed at unconfigure."""


def pytest_configure(config):
    """A run of the default test paths starts the Prefect and MLflow servers now, to boot during collection."""
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.collectonly:
        root = Path(tempfile.mkdtemp(prefix="ppoflow-early-servers-"))
        config.stash[EARLY_ROOT] = root
        (root / "prefect-home").mkdir()
        (root / "mlflow").mkdir()
        EARLY["prefect"] = start_prefect_server(root / "prefect-home", free_port())
        EARLY["mlflow"] = start_mlflow_server(root / "mlflow", free_port())


def pytest_unconfigure(config):
    for name in list(EARLY):
        EARLY.pop(name).stop()
    if EARLY_ROOT in config.stash:
        shutil.rmtree(config.stash[EARLY_ROOT], ignore_errors=True)


# --- prefect_server: a real `ppoflow server` for the session --------------------------------------


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """``ppoflow server`` (``prefect server start`` with ppoflow's settings) on a free port with its own
    PREFECT_HOME, started early (:mod:`tests.servers`) or now; yields its API URL.

    The URL is also exported as PREFECT_API_URL so that subprocesses (CLI runs, serve processes)
    report to the same server. Tests running flows in this process use :func:`prefect_api`.
    """
    server = adopt_or_start(
        "prefect", lambda: start_prefect_server(tmp_path_factory.mktemp("prefect-home"), free_port())
    )
    try:
        server.wait_until_healthy()
        with pytest.MonkeyPatch.context() as environment:
            environment.setenv("PREFECT_API_URL", server.url)
            yield server.url
    finally:
        server.stop()


@pytest.fixture
def prefect_api(prefect_server):
    """Point this test's Prefect client at the session server, with flow heartbeats off (they add
    ~1 s per flow run and only matter for crash detection of deployed runs)."""
    with prefect_settings(prefect_server):
        yield prefect_server
        drain_prefect_logs()


def drain_prefect_logs() -> None:
    """Send queued run logs now, while the server is up (at interpreter exit it is gone, and every
    attempt would wait for a connection timeout)."""
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)


REPLAY_STEPS = 2
REPLAY_EPOCHS = "actor_rollout_ref.actor.ppo_epochs=2"
"""Two PPO epochs in the golden recording (and its checks): in the second epoch the ratios move away from
1, so the clip range changes the loss (with one epoch over one mini-batch every ratio is exactly 1)."""


@pytest.fixture(scope="session")
def replay_baseline(prefect_server, ray_local, tiny_model, tmp_path_factory):
    """A 2-step golden baseline (``ppoflow replay record``), recorded once for the session."""
    from ppoflow.flows.cli import main as cli

    root = tmp_path_factory.mktemp("replay")
    overrides = [word for word in small_run(tiny_model, root) if not word.startswith(("trainer.", "data.val_files"))]
    overrides += [
        "data.val_files=null",
        f"trainer.total_training_steps={REPLAY_STEPS}",
        "trainer.logger=[]",
        REPLAY_EPOCHS,
    ]
    with prefect_settings(prefect_server):
        assert cli(["replay", "record", "--dir", str(root / "baseline"), *overrides]) == 0
        drain_prefect_logs()
    return root / "baseline"


@pytest.fixture(scope="session")
def golden(prefect_server, ray_local, tiny_model, tmp_path_factory):
    """One run that dumps steps 1-4 (rollout and reward) while validating at steps 0 and 4 (validation is
    never dumped; a step 0 in ``skip.*.steps`` is refused by the config); tests copy its dump and replay,
    damage or reshape the copy."""
    from types import SimpleNamespace

    from tests.flow_runs import rollout_skip, small, train_run

    root = tmp_path_factory.mktemp("golden")
    skip = {
        **rollout_skip(root / "dump", [1, 2, 3, 4]),
        "reward.enable": "true",
        "reward.dump_dir": str(root / "dump"),
        "reward.steps": "[1,2,3,4]",
    }
    words = [w for w in small(root, tiny_model) if not w.startswith("data.val_files")] + [
        f"data.val_files={root}/data/val.parquet",
        "trainer.val_before_train=true",
        "trainer.task_run_tags=true",
    ]
    with prefect_settings(prefect_server):
        rows, states, flow_run_id = train_run(words + ["trainer.test_freq=4"], root / "run", 4, skip, validations=2)
    return SimpleNamespace(
        root=root,
        dump=root / "dump",
        rows=rows,
        states=states,
        skip=skip,
        overrides=small(root, tiny_model),
        flow_run_id=flow_run_id,
    )


# --- ray_local: one local Ray for the whole session ---------------------------------------------


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray shared by every test that needs one (runs reuse it instead of starting their own), its
    workers on the allocator a run's own local Ray gives them (``ray.worker_allocator``'s default)."""
    import ray

    from ppoflow.workers.launcher import allocator_env

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": allocator_env("jemalloc")},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


# --- tiny_model: the demo's model, built once per session -----------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-init tiny Llama + character tokenizer written with ``save_pretrained``."""
    from ppoflow.configs.schema import TinyModelConfig
    from ppoflow.workers.models import build_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny_llama"
    build_tiny_model(
        str(path),
        TinyModelConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            seed=0,
        ),
    )
    return str(path)


def small_run(tiny_model: str, root) -> list[str]:
    """Overrides that make the grpo_tiny preset small and self-contained under ``root``."""
    return [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={root}/data/train.parquet",
        f"data.val_files={root}/data/val.parquet",
        "data.synthetic.train_rows=64",
        "data.synthetic.val_rows=8",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.logger=[]",
        f"trainer.default_local_dir={root}/run",
    ]


@pytest.fixture
def tiny_overrides(tiny_model, tmp_path) -> list[str]:
    return small_run(tiny_model, tmp_path)


def prefect_settings(url: str):
    """The settings context of :func:`prefect_api`, for module-scoped fixtures that run flows."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def model_config(path):
    """A model section (``ModelConfig``) for ``path`` as the defaults have it (float32, no checkpointing, no build
    recipe)."""
    from ppoflow.configs.schema import ModelConfig

    return ModelConfig(path=str(path), tokenizer_path=None, trust_remote_code=False, dtype="float32",
                       enable_gradient_checkpointing=False, use_remove_padding=False, build=None, lora_rank=0,
                       lora_alpha=16, target_modules="all-linear", lora_adapter_path=None)  # fmt: skip


# --- root, cache: a step cache for tests/test_step_cache*.py (tests/step_cache_helpers.py) -------


@pytest.fixture
def root(tmp_path) -> str:
    from ppoflow.storage.step_cache import config_dir
    from tests.step_cache_helpers import CONFIG

    return config_dir(str(tmp_path / "dump"), **CONFIG)


@pytest.fixture
def cache(root: str):
    from ppoflow.storage.step_cache import StepCache

    return StepCache(root, write_retries=2, retry_backoff_s=0)


# --- tool_folder, specs: the test tools of tests/test_tools*.py (tests/tools_helpers.py) ---------


@pytest.fixture(scope="module")
def tool_folder(tmp_path_factory):
    """A folder with the test tools (tools.py) and their config (tools.yaml)."""
    import yaml

    from tests.tools_helpers import TOOL_FUNCTIONS, TOOLS

    folder = tmp_path_factory.mktemp("tools")
    (folder / "tools.py").write_text(TOOL_FUNCTIONS)
    (folder / "tools.yaml").write_text(yaml.safe_dump({"tools": TOOLS}))
    return folder


@pytest.fixture(scope="module")
def specs(tool_folder):
    from ppoflow.workers.service.tool_config import load_tool_config

    return load_tool_config(str(tool_folder / "tools.yaml"))


@pytest.fixture
def prompts(cfg):
    """Three prompts of the training set of the test module's ``cfg``, as a worker's ``generate`` takes them."""
    from ppoflow.data.datasets import ensure_datasets, load_prompt_dataset
    from ppoflow.workers.models import load_tokenizer

    ensure_datasets(cfg.data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    dataset = load_prompt_dataset(cfg.data.train_files, cfg.data, tokenizer, key="data.train_files")
    return dataset.batch([0, 1, 2], ["a", "b", "c"], tokenizer.pad_token_id).exclude(
        "uid", "data_source", "ground_truth"
    )
