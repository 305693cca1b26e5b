"""Bad input ends before Prefect or Ray start: exit code 2, one message naming the key or file, no traceback.

Most cases run the command line in this process (``main([...])``); three run it as a real subprocess, to
see what a user sees on the terminal.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
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
from ppoflow.workers.models import ensure_model, holds_model
from tests.conftest import free_port
from tests.test_caching import sample_batch

pytestmark = pytest.mark.reliability

RAY_STARTED = ("Started a local Ray instance", "Connecting to existing Ray cluster")


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``ppoflow argv...`` in this process: its exit code and what it wrote to stderr."""
    code = main(list(argv))
    return code, capsys.readouterr().err


def assert_user_error(code: int, stderr: str, *named: str) -> None:
    assert code == 2, stderr
    assert "\nppoflow: " in f"\n{stderr}", stderr  # after any warning logged while waiting for storage
    for text in named:
        assert text in stderr, (text, stderr)
    assert "Traceback" not in stderr


def run_dir(tmp_path) -> str:
    return f"trainer.default_local_dir={tmp_path}/run"


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
    assert_user_error(*run_cli(capsys, "train", word, run_dir(tmp_path)), f"  {key}: ")


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
        main(["--debug", "train", "actor_rollout_ref.actor.optim.lr=.inf"])
    monkeypatch.setenv("PPOFLOW_DEBUG", "1")
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.optim.lr"):
        main(["train", "actor_rollout_ref.actor.optim.lr=.inf"])


# ----------------------------------------------------------------------------------------- storage


def test_an_unwritable_run_directory(capsys, tmp_path, tiny_overrides):
    (tmp_path / "file").write_text("a regular file")
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"trainer.default_local_dir={tmp_path}/file/run")
    assert_user_error(code, stderr, f"trainer.default_local_dir: {tmp_path}/file/run cannot be used: Not a directory")


def test_a_checkpoint_to_resume_from_must_be_complete(capsys, tmp_path, tiny_overrides):
    resume = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/old/global_step_3"]
    code, stderr = run_cli(capsys, "train", *tiny_overrides, *resume)
    assert_user_error(
        code, stderr, f"trainer.resume_from_path: no such checkpoint directory {tmp_path}/old/global_step_3"
    )
    (tmp_path / "old/global_step_3").mkdir(parents=True)  # a crash mid-save: no marker
    code, stderr = run_cli(capsys, "train", *tiny_overrides, *resume)
    assert_user_error(
        code, stderr, f"trainer.resume_from_path: {tmp_path}/old/global_step_3 is not a complete checkpoint"
    )


def test_an_unreachable_cache_endpoint(capsys, monkeypatch, tiny_overrides):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")  # credentials, so that the probe gets as far as the endpoint
    endpoint = f"http://127.0.0.1:{free_port()}"
    code, stderr = run_cli(
        capsys,
        "train",
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
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"ray.address={address}")
    assert_user_error(code, stderr, f"ray.address: no Ray cluster answers at {address}")
    monkeypatch.setenv("RAY_ADDRESS", f"ray://{address}")
    assert_user_error(
        *run_cli(capsys, "train", *tiny_overrides), f"RAY_ADDRESS: no Ray cluster answers at ray://{address}"
    )
    assert_user_error(
        *run_cli(capsys, "train", *tiny_overrides, "ray.address=somewhere"),
        "ray.address: 'somewhere' is not host:port or ray://host:port",
    )


def test_a_tcp_listener_that_is_not_ray(capsys, tiny_overrides):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        started = time.monotonic()
        code, stderr = run_cli(capsys, "train", *tiny_overrides, f"ray.address={address}")
        assert_user_error(code, stderr, f"ray.address: {address} accepts connections but is not a Ray cluster")
        assert time.monotonic() - started < 60  # bounded: ray.init would retry against it for minutes
        code, stderr = run_cli(capsys, "train", *tiny_overrides, f"ray.address=ray://{address}")
        assert_user_error(code, stderr, f"ray.address: ray://{address} accepts connections but is not a Ray client")
    finally:
        server.shutdown()
        server.server_close()


def test_a_running_ray_cluster_passes(ray_local, tiny_overrides):
    gcs_address = ray_local.get_runtime_context().gcs_address
    preflight(load_config("grpo_tiny", tiny_overrides + [f"ray.address={gcs_address}"]))  # no ConfigError


# ------------------------------------------------------------------------------------ models, data


def test_a_missing_model_path_is_an_error_unless_building_is_asked_for(capsys, tmp_path, tiny_overrides):
    typo = tmp_path / "modle"
    words = [word for word in tiny_overrides if not word.startswith("actor_rollout_ref.model.path")]
    code, stderr = run_cli(
        capsys, "train", f"actor_rollout_ref.model.path={typo}", run_dir(tmp_path)
    )  # the demo preset
    assert_user_error(
        code,
        stderr,
        f"actor_rollout_ref.model.path: {str(typo)!r} holds no Hugging Face model",
        "actor_rollout_ref.model.build.seed=0",
    )
    assert not typo.exists()

    cfg = load_config(
        "grpo_tiny", words + [f"actor_rollout_ref.model.path={typo}", "actor_rollout_ref.model.build.seed=1"]
    )
    preflight(cfg)  # the recipe's context length fits; nothing is built yet
    assert not typo.exists()
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    assert capsys.readouterr().out == (
        f"building a random-init tiny Llama into {typo} (actor_rollout_ref.model.build "
        f"is set and {typo} holds no model)\n"
    )
    assert holds_model(str(typo))


def test_a_missing_critic_model(capsys, tmp_path, tiny_overrides):
    code, stderr = run_cli(
        capsys, "train", *tiny_overrides, "algorithm.adv_estimator=gae", f"critic.model.path={tmp_path}/no_critic"
    )
    assert_user_error(code, stderr, "critic.model.path: ", "critic.model.build.seed=0")


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "config.json is unreadable"),
        ('{"hidden_size": 64}', "is not a Hugging Face model config (a JSON object with a model_type)"),
    ],
)
def test_a_garbage_config_json(capsys, tmp_path, tiny_model, tiny_overrides, content, message):
    shutil.copytree(tiny_model, tmp_path / "model")
    (tmp_path / "model/config.json").write_text(content)
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"actor_rollout_ref.model.path={tmp_path}/model")
    assert_user_error(code, stderr, "actor_rollout_ref.model.path: ", f"{tmp_path}/model/config.json", message)


def test_a_missing_data_file_is_an_error_unless_generating_is_asked_for(capsys, tmp_path, tiny_model):
    typo = f"{tmp_path}/trian.parquet"
    code, stderr = run_cli(
        capsys,
        "train",
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={typo}",
        f"data.val_files={tmp_path}/val.parquet",
        run_dir(tmp_path),
    )
    assert_user_error(code, stderr, f"data.train_files: no such file {typo!r}", "data.val_files: no such file")


def test_a_zero_byte_parquet(capsys, tmp_path, tiny_overrides):
    (tmp_path / "zero.parquet").write_bytes(b"")
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"data.train_files={tmp_path}/zero.parquet")
    assert_user_error(code, stderr, f"data.train_files: '{tmp_path}/zero.parquet' is not a readable parquet file")


def test_rows_are_tokenized_and_every_source_has_a_scorer(capsys, tmp_path, tiny_overrides):
    rows = [
        {"data_source": "my/task", "prompt": "12>", "reward_model": {"ground_truth": "12"}},
        {"data_source": "synthetic/copy", "prompt": "123456789012>", "reward_model": {"ground_truth": "1"}},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"data.train_files={tmp_path}/rows.jsonl")
    assert_user_error(
        code,
        stderr,
        "data.train_files: row 1 prompt has 13 tokens > data.max_prompt_length=8",
        "data.train_files: no reward scorer for data_source 'my/task'",
    )
    code, stderr = run_cli(
        capsys,
        "train",
        *tiny_overrides,
        f"data.train_files={tmp_path}/rows.jsonl",
        "data.filter_overlong_prompts=true",
        "custom_reward_function.path=ppoflow.algorithms.scoring",
        "custom_reward_function.name=copy_score",
    )
    assert_user_error(code, stderr, "data.train_batch_size: 4 is larger than the 1 train prompts")


def test_a_reward_module_that_raises_on_import(capsys, tmp_path, tiny_overrides):
    (tmp_path / "my_reward.py").write_text("raise RuntimeError('SANDBOX_URL is not set')\n")
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"custom_reward_function.path={tmp_path}/my_reward.py")
    assert_user_error(
        code,
        stderr,
        f"custom_reward_function.path: cannot import '{tmp_path}/my_reward.py': RuntimeError: SANDBOX_URL is not set",
    )


BAD_SCORERS = {
    "raises": ("raise KeyError('judge_url')", "raised KeyError: 'judge_url'"),
    "returns_text": ("return '1.0'", "returned a str ('1.0'), not a number or a dict with a number under 'score'"),
    "returns_none": ("return None", "returned None, not a number"),
    "no_score": ("return {'accuracy': 1.0}", "returned a dict without 'score' (keys: 'accuracy')"),
    "exits": ("import os; os._exit(3)", "crashed: its process exited with code 3"),
}


@pytest.mark.parametrize("name", [*BAD_SCORERS, "signature"])
def test_a_custom_scorer_is_called_on_the_first_row(capsys, tmp_path, tiny_overrides, name):
    body, message = BAD_SCORERS.get(
        name, ("return 1.0", "raised TypeError: compute_score() missing 1 required positional argument: 'extra_info'")
    )
    signature = (
        "data_source, solution_str, ground_truth, extra_info"
        if name == "signature"
        else "data_source, solution_str, ground_truth, extra_info=None"
    )
    (tmp_path / "my_reward.py").write_text(f"def compute_score({signature}):\n    {body}\n")
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"custom_reward_function.path={tmp_path}/my_reward.py")
    assert_user_error(
        code,
        stderr,
        f"custom_reward_function.path: the custom scorer '{tmp_path}/my_reward.py:compute_score' {message}",
        "the first row of data.train_files",
    )
    assert "Connecting to existing Ray cluster" not in stderr


@pytest.mark.parametrize("on_timeout", ["fail", "score"])
def test_a_custom_scorer_that_hangs_on_the_first_row(capsys, tmp_path, tiny_overrides, on_timeout):
    """Bounded by the run's own deadline, whatever on_timeout says; the hung process is gone."""
    (tmp_path / "my_reward.py").write_text(
        "import os, time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    open(__file__ + '.pid', 'w').write(str(os.getpid()))\n"
        "    time.sleep(10**9)\n"
    )
    code, stderr = run_cli(
        capsys,
        "train",
        *tiny_overrides,
        f"custom_reward_function.path={tmp_path}/my_reward.py",
        "custom_reward_function.timeout_s=1",
        f"custom_reward_function.on_timeout={on_timeout}",
    )
    assert_user_error(
        code,
        stderr,
        f"custom_reward_function.timeout_s: the custom scorer '{tmp_path}/my_reward.py:"
        "compute_score' did not return within custom_reward_function.timeout_s=1 s (its "
        "process was killed) while scoring the first row of data.train_files (data source "
        "'synthetic/copy'), called as the reward stage calls it",
    )
    assert not os.path.exists(f"/proc/{int((tmp_path / 'my_reward.py.pid').read_text())}")


def test_a_custom_scorer_that_exits_while_imported(capsys, tmp_path, tiny_overrides):
    (tmp_path / "my_reward.py").write_text("import os\nos._exit(3)\n")
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"custom_reward_function.path={tmp_path}/my_reward.py")
    assert_user_error(
        code, stderr, "custom_reward_function.path: the custom scorer", "exited with code 3 while importing"
    )


def test_a_working_custom_scorer_passes(tmp_path, tiny_overrides):
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "my_reward.py").write_text(
        "import json\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    open({str(calls)!r}, 'a').write(json.dumps([data_source, solution_str, ground_truth]) + '\\n')\n"
        "    return {'score': 1.0, 'length': len(solution_str)}\n"
    )
    cfg = load_config("grpo_tiny", tiny_overrides + [f"custom_reward_function.path={tmp_path}/my_reward.py"])
    preflight(cfg)  # data.synthetic: the first train row is generated in memory, the file is not written yet
    assert not os.path.exists(cfg.data.train_files)
    ((source, solution, truth),) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert source == "synthetic/copy" and solution == truth and truth.isdigit()


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
