"""Bad input ends before Prefect or Ray start: exit code 2, one message naming the key or file, no traceback.

Values, storage, Ray, the cache commands, every problem at once. Most cases run the command line in this
process (``main([...])``); three run it as a real subprocess, to see what a user sees on the terminal. Models,
data and reward scorers: tests/test_preflight_data.py.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest
import s3fs

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.cli import main
from ppoflow.flows.preflight import preflight
from ppoflow.storage.step_cache import StepCache, config_dir
from tests.conftest import free_port
from tests.preflight_helpers import DEMO, assert_user_error, run_cli, run_dir
from tests.test_caching import sample_batch

pytestmark = pytest.mark.reliability

RAY_STARTED = ("Started a local Ray instance", "Connecting to existing Ray cluster")


# ------------------------------------------------------------------------------------------ values


@pytest.mark.parametrize(
    "word, key",
    [
        ("actor_rollout_ref.actor.optim.lr=inf", "actor_rollout_ref.actor.optim.lr"),
        ("actor_rollout_ref.actor.optim.lr=.inf", "actor_rollout_ref.actor.optim.lr"),
        ("actor_rollout_ref.actor.optim.betas=[1.5,2.0]", "actor_rollout_ref.actor.optim.betas.0"),
        ("actor_rollout_ref.actor.optim.betas=[.nan,0.99]", "actor_rollout_ref.actor.optim.betas.0"),
        ("actor_rollout_ref.model.build.num_attention_heads=3", "actor_rollout_ref.model.build.num_attention_heads"),
    ],
)
def test_bad_values(capsys, tmp_path, word, key):
    assert_user_error(*run_cli(capsys, *DEMO, word, run_dir(tmp_path)), f"  {key}: ")


def test_build_tiny_model_refuses_heads_that_do_not_divide(capsys, tmp_path):
    code, stderr = run_cli(capsys, "build-tiny-model", str(tmp_path / "m"), "num_attention_heads=3")
    assert_user_error(code, stderr, "num_attention_heads: must divide hidden_size=128 (got 3)")
    assert not (tmp_path / "m").exists()


def test_a_yaml_that_is_a_list(capsys, tmp_path):
    (tmp_path / "run.yaml").write_text("- data\n- trainer\n")
    assert_user_error(
        *run_cli(capsys, "train", "--config", str(tmp_path / "run.yaml")), str(tmp_path / "run.yaml"), "not a list"
    )


def test_the_debug_switch_shows_the_traceback(monkeypatch):
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lr"):
        main(["--debug", "train", "--config", "grpo_tiny", "actor_rollout_ref.actor.optim.lr=.inf"])
    monkeypatch.setenv("PPOFLOW_DEBUG", "1")
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lr"):
        main(["train", "--config", "grpo_tiny", "actor_rollout_ref.actor.optim.lr=.inf"])


# ----------------------------------------------------------------------------------------- storage


def test_an_unwritable_run_directory(capsys, tmp_path, tiny_overrides):
    (tmp_path / "file").write_text("a regular file")
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"trainer.default_local_dir={tmp_path}/file/run")
    assert_user_error(code, stderr, f"trainer.default_local_dir: {tmp_path}/file/run cannot be used: Not a directory")


def test_a_checkpoint_to_resume_from_must_be_complete(capsys, tmp_path, tiny_overrides):
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/old/global_step_3"]
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, *resume)
    assert_user_error(
        code, stderr, f"trainer.resume_from_path: no such checkpoint directory {tmp_path}/old/global_step_3"
    )
    (tmp_path / "old/global_step_3").mkdir(parents=True)  # a crash mid-save: no marker
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, *resume)
    assert_user_error(
        code, stderr, f"trainer.resume_from_path: {tmp_path}/old/global_step_3 is not a complete checkpoint"
    )


def test_an_unreachable_cache_endpoint(capsys, monkeypatch, tiny_overrides):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")  # credentials, so that the probe gets as far as the endpoint
    endpoint = f"http://127.0.0.1:{free_port()}"
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        "skip.rollout.enable=true",
        "skip.rollout.steps=[1]",
        "skip.rollout.dump_dir=s3://ppoflow-test/unreachable",
        f"skip.rollout.storage_options.client_kwargs.endpoint_url={endpoint}",
    )
    assert_user_error(code, stderr, "skip.rollout.dump_dir: ", "s3://ppoflow-test/unreachable")


def test_a_reachable_cache_passes(s3_server, tiny_overrides):
    endpoint, _ = s3_server
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [
            "skip.rollout.enable=true",
            "skip.rollout.steps=[1]",
            "skip.rollout.dump_dir=s3://ppoflow-test/preflight",
            f"skip.rollout.storage_options.client_kwargs.endpoint_url={endpoint}",
        ],
    )
    preflight(cfg)  # the probe file was written and removed again
    assert s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).find("ppoflow-test/preflight") == []


# --------------------------------------------------------------------------------------------- ray


def test_an_unreachable_ray_address(capsys, monkeypatch, tiny_overrides):
    address = f"127.0.0.1:{free_port()}"
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"ray.address={address}")
    assert_user_error(code, stderr, f"ray.address: no Ray cluster answers at {address}")
    monkeypatch.setenv("RAY_ADDRESS", f"ray://{address}")
    assert_user_error(
        *run_cli(capsys, *DEMO, *tiny_overrides),
        f"RAY_ADDRESS: no Ray cluster answers at ray://{address}",
    )
    assert_user_error(
        *run_cli(capsys, *DEMO, *tiny_overrides, "ray.address=somewhere"),
        "ray.address: 'somewhere' is not host:port or ray://host:port",
    )


def test_a_tcp_listener_that_is_not_ray(capsys, tiny_overrides):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        started = time.monotonic()
        code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"ray.address={address}")
        assert_user_error(code, stderr, f"ray.address: {address} accepts connections but is not a Ray cluster")
        assert time.monotonic() - started < 60  # bounded: ray.init would retry against it for minutes
        code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"ray.address=ray://{address}")
        assert_user_error(code, stderr, f"ray.address: ray://{address} accepts connections but is not a Ray client")
    finally:
        server.shutdown()
        server.server_close()


def test_a_running_ray_cluster_passes(ray_local, tiny_overrides):
    gcs_address = ray_local.get_runtime_context().gcs_address
    preflight(load_config("grpo_tiny", tiny_overrides + [f"ray.address={gcs_address}"]))  # no ConfigError


def test_every_problem_is_listed_at_once(tmp_path, tiny_overrides):
    (tmp_path / "file").write_text("")
    (tmp_path / "zero.parquet").write_bytes(b"")
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [
            f"trainer.default_local_dir={tmp_path}/file/run",
            f"ray.address=127.0.0.1:{free_port()}",
            f"data.train_files={tmp_path}/zero.parquet",
            "custom_reward_function.path=ppoflow_no_such_module",
        ],
    )
    with pytest.raises(ConfigError) as caught:
        preflight(cfg)
    assert [key for key, _ in caught.value.problems] == [
        "trainer.default_local_dir",
        "ray.address",
        "data.train_files",
        "custom_reward_function.path",
    ]


# ------------------------------------------------------------------------------------------- cache


@pytest.fixture
def cached_step(tmp_path) -> tuple[str, StepCache]:
    dump = str(tmp_path / "dump")
    cache = StepCache(
        config_dir(dump, experiment_name="e", project_name="p", gbs=2, n=1, max_prompt_length=3, max_response_length=3)
    )
    cache.write(1, sample_batch())
    return dump, cache


def test_cache_commands_refuse_bad_storage_options(capsys, cached_step):
    dump, _ = cached_step
    code, stderr = run_cli(capsys, "cache", "ls", dump, "--storage-options", "not json")
    assert_user_error(code, stderr, "--storage-options: 'not json' is not JSON")
    assert stderr.count("\n") == 1
    code, stderr = run_cli(capsys, "cache", "rm", dump, "--step", "1", "--storage-options", "[1]")
    assert_user_error(code, stderr, "--storage-options: '[1]' is not a JSON object")


def test_cache_show_on_a_damaged_or_oversized_step(capsys, cached_step):
    dump, cache = cached_step
    code, stderr = run_cli(capsys, "cache", "show", dump, "--step", "1", "--max-bytes", "10")
    assert_user_error(code, stderr, f"ppoflow: {cache.payload_url(1)}: ", "more than the 10 allowed")
    payload = cache.payload_url(1)
    data = bytearray(open(payload, "rb").read())
    data[-1] ^= 0xFF  # same size, other bytes: only the checksum notices
    open(payload, "wb").write(bytes(data))
    code, stderr = run_cli(capsys, "cache", "show", dump, "--step", "1")
    assert_user_error(code, stderr, f"ppoflow: {payload}: ")
    assert stderr.count("\n") == 1
    assert_user_error(*run_cli(capsys, "cache", "show", dump, "--step", "7"), f"ppoflow: {dump}: step 7 matches 0")


# ------------------------------------------------------------------------------ what a user sees


def cli_subprocess(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppoflow.flows.cli", *argv], capture_output=True, text=True, timeout=300, env=env
    )


def assert_no_traceback_and_no_ray(result: subprocess.CompletedProcess, *named: str) -> None:
    assert_user_error(result.returncode, result.stderr, *named)
    for line in RAY_STARTED:
        assert line not in result.stdout + result.stderr


@pytest.mark.slow
def test_subprocess_storage_ray_data_and_reward_problems(tmp_path, tiny_overrides):
    (tmp_path / "file").write_text("")
    (tmp_path / "zero.parquet").write_bytes(b"")
    (tmp_path / "my_reward.py").write_text("raise ImportError('no module named sandbox')\n")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    result = cli_subprocess(
        "train",
        "--config",
        "grpo_tiny",
        *tiny_overrides,
        f"trainer.default_local_dir={tmp_path}/file/run",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path}/global_step_1",
        "skip.rollout.enable=true",
        "skip.rollout.steps=[1]",
        "skip.rollout.dump_dir=s3://b/c",
        f"skip.rollout.storage_options.client_kwargs.endpoint_url=http://127.0.0.1:{free_port()}",
        f"ray.address=127.0.0.1:{free_port()}",
        f"data.train_files={tmp_path}/zero.parquet",
        f"custom_reward_function.path={tmp_path}/my_reward.py",
        env=env,
    )
    assert_no_traceback_and_no_ray(
        result,
        "invalid configuration (6 problems)",
        "trainer.default_local_dir",
        "trainer.resume_from_path",
        "skip.rollout.dump_dir",
        "ray.address",
        "data.train_files",
        "custom_reward_function.path",
    )


@pytest.mark.slow
def test_subprocess_yaml_list(tmp_path):
    (tmp_path / "run.yaml").write_text("- data\n")
    assert_no_traceback_and_no_ray(
        cli_subprocess("train", "--config", str(tmp_path / "run.yaml")), str(tmp_path / "run.yaml")
    )


@pytest.mark.slow
def test_subprocess_cache_show_on_a_damaged_step(cached_step):
    dump, cache = cached_step
    open(cache.marker_url(1), "w").write("{garbage")
    result = cli_subprocess("cache", "show", dump, "--step", "1")
    assert_no_traceback_and_no_ray(result, cache.marker_url(1))
    assert result.stderr.count("\n") == 1
