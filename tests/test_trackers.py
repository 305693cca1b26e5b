"""Trackers and generation dumps end to end: a tiny in-process run logging to a real ``mlflow server``
(SQLite, temp artifacts) and verl's file logger, dumping its generations locally; read back independently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from ppoflow.configs import ConfigError, config_as_dict, load_config
from ppoflow.flows.cli import main
from ppoflow.flows.dumps import read_dump
from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import train
from tests.conftest import free_port, small_run
from tests.outage_proxy import OutageProxy
from tests.preflight_helpers import DEMO, assert_user_error, run_cli
from tests.servers import adopt_or_start, start_mlflow_server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 (SQLite backend, temp artifacts), started early or now; stopped after."""
    server = adopt_or_start("mlflow", lambda: start_mlflow_server(tmp_path_factory.mktemp("mlflow"), free_port()))
    try:
        server.wait_until_healthy()
        yield server.url
    finally:
        server.stop()


def test_a_run_logs_to_mlflow_and_the_file_logger_and_dumps_its_generations(
    mlflow_server, tiny_model, tmp_path, monkeypatch, capsys
):
    from mlflow import MlflowClient

    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(tmp_path / "files"))
    words = small_run(tiny_model, tmp_path) + [
        "trainer.logger=[file,mlflow]",
        f"trainer.mlflow_tracking_uri={mlflow_server}",
        "trainer.project_name=trk",
        "trainer.experiment_name=e1",
        "trainer.save_freq=1",
        "trainer.log_val_generations=2",
        f"trainer.rollout_data_dir={tmp_path}/rollouts",
        f"trainer.validation_data_dir={tmp_path}/val",
    ]
    train(load_config("grpo_tiny", words), orchestrated=False)
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["step"] for row in rows] == [1, 2]

    # verl's file logger: {"step", "data"} per step, the same values as metrics.jsonl
    lines = [json.loads(line) for line in (tmp_path / "files" / "trk" / "e1.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[1]["data"]["critic/score/mean"] == pytest.approx(rows[1]["critic/score/mean"], abs=1e-12)

    # the dumps: one file per step, 4 prompts x n=4 samples; their mean score is the step's logged score
    for row in rows:
        dumped = read_dump(str(tmp_path / "rollouts"), row["step"])
        assert len(dumped) == 16 and {"uid", "input", "output", "gts", "data_source", "weight_version"} <= set(
            dumped[0]
        )
        assert sum(line["score"] for line in dumped) / 16 == pytest.approx(row["critic/score/mean"], abs=1e-6)
    assert len(read_dump(str(tmp_path / "val"), 2)) == 8  # 8 validation rows, val_kwargs.n=1
    capsys.readouterr()  # the run's own output
    assert main(["dump", "show", str(tmp_path / "rollouts"), "--step", "2", "--worst", "3"]) == 0
    shown = capsys.readouterr().out
    worst = sorted(line["score"] for line in read_dump(str(tmp_path / "rollouts"), 2))[:3]
    assert shown.startswith("step 2: the 3 lowest-scoring of 16 samples")
    assert [float(part.split(",")[0]) for part in shown.split("score ")[1:]] == pytest.approx(worst, abs=1e-3)

    # MLflow: one run in experiment "trk" named "e1", every step's metrics once, the config, the artifacts
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    assert run.info.run_name == "e1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [m.step for m in history] == [row["step"] for row in rows]
    assert [m.value for m in history] == pytest.approx([row["critic/score/mean"] for row in rows], abs=1e-6)
    assert run.data.params["data/train_batch_size"] == "4"
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"reward_curve.png", "val_step2.json"} <= artifacts
    table = json.loads(open(client.download_artifacts(run.info.run_id, "val_step2.json", str(tmp_path))).read())
    assert len(table) == 2 and set(table[0]) == {"input", "output", "score"}

    # resume from step 1's checkpoint up to step 3: the same MLflow run, each step once
    words = [word for word in words if not word.startswith("trainer.total_training_steps")]
    words += ["trainer.total_training_steps=3", "trainer.resume_mode=resume_path"]
    words += [f"trainer.resume_from_path={tmp_path}/run/global_step_1"]
    train(load_config("grpo_tiny", words), orchestrated=False)
    (again,) = client.search_runs([run.info.experiment_id])
    assert again.info.run_id == run.info.run_id
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")]
    assert steps == [1, 2, 3]


def test_a_tracker_that_is_down_warns_and_the_run_goes_on(tiny_model, tmp_path, caplog):
    words = small_run(tiny_model, tmp_path) + [
        "trainer.logger=[mlflow]",
        f"trainer.mlflow_tracking_uri=http://127.0.0.1:{free_port()}",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=1",
    ]
    train(load_config("grpo_tiny", words), orchestrated=False)
    assert [row["step"] for row in read_metrics(str(tmp_path / "run"))] == [1]
    assert any("trainer.logger=mlflow: could not start" in record.message for record in caplog.records)


def test_a_tracker_that_fails_mid_run_warns_once_and_the_run_goes_on(mlflow_server, tiny_model, tmp_path, caplog):
    """The MLflow server goes away (connections refused) once step 1 is in metrics.jsonl: one warning, the
    run finishes its 3 steps, metrics.jsonl has them all and MLflow no step after the outage."""
    from mlflow import MlflowClient

    proxy = OutageProxy(int(mlflow_server.rsplit(":", 1)[1]))
    metrics = tmp_path / "run" / "metrics.jsonl"

    def cut_after_step_1() -> None:
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.02)
        proxy.switch("refuse")

    watcher = threading.Thread(target=cut_after_step_1, daemon=True)
    watcher.start()
    words = small_run(tiny_model, tmp_path) + [
        "trainer.logger=[mlflow]",
        f"trainer.mlflow_tracking_uri={proxy.endpoint}",
        "trainer.project_name=outage",
        "trainer.test_freq=-1",
        "trainer.total_training_steps=3",
    ]
    try:
        train(load_config("grpo_tiny", words), orchestrated=False)
    finally:
        proxy.close()
    assert [row["step"] for row in read_metrics(str(tmp_path / "run"))] == [1, 2, 3]
    warned = [record.message for record in caplog.records if "trainer.logger=mlflow failed" in record.message]
    assert len(warned) == 1, warned
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] in ([], [1])


@pytest.mark.parametrize(
    "word, key",
    [
        ("trainer.logger=[console,swanlab]", "trainer.logger"),
        ("trainer.mlflow_tracking_uri=ftp://x", "trainer.mlflow_tracking_uri"),
    ],
)
def test_an_unknown_logger_or_unreadable_uri_is_a_config_error(word, key):
    with pytest.raises(ConfigError) as error:
        load_config("grpo_tiny", [word])
    assert [problem[0] for problem in error.value.problems] == [key]


def test_unknown_logger_ends_the_cli_with_exit_2_naming_it(capsys, tmp_path):
    code, stderr = run_cli(
        capsys,
        *DEMO,
        "trainer.logger=[console,swanlab]",
        f"trainer.default_local_dir={tmp_path}",
    )
    assert_user_error(code, stderr, "trainer.logger", "swanlab")


TRAIN_IN_PROCESS = (
    "import json, sys\n"
    "from ppoflow.configs import load_config\n"
    "from ppoflow.flows.train import train\n"
    "train(load_config('grpo_tiny', json.loads(sys.argv[1])), orchestrated=False)\n"
)
READ_TRACKIO = (
    "import json, sys\n"
    "import trackio\n"
    "from trackio.sqlite_storage import SQLiteStorage\n"
    "(run,) = trackio.Api().runs(sys.argv[1])\n"
    "logs = SQLiteStorage.get_logs(sys.argv[1], run.name)\n"
    "print(json.dumps({'name': run.name, 'config': run.config, 'logs': logs}, default=str))\n"
)


@pytest.mark.slow  # a run in a process of its own (~13 s); the MLflow run and the tracker faults run by default
def test_an_offline_wandb_run_and_a_trackio_run_read_back_with_their_own_readers(tiny_model, tmp_path):
    """wandb offline (``WANDB_MODE=offline``) and trackio (local, ``TRACKIO_DIR``) in a run of its own process
    (trackio reads TRACKIO_DIR once, at import); read back with ``wandb leet inspect --json`` (wandb-core's
    reader of the run's .wandb transaction log) and trackio's own API."""
    words = small_run(tiny_model, tmp_path) + [
        "trainer.logger=[wandb,trackio]",
        "trainer.project_name=trk",
        "trainer.experiment_name=e2",
        "trainer.log_val_generations=2",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TRACKIO_DIR": str(tmp_path / "trackio")}
    subprocess.run([sys.executable, "-c", TRAIN_IN_PROCESS, json.dumps(words)], env=env, check=True, timeout=600)
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["step"] for row in rows] == [1, 2]
    expected_config = config_as_dict(load_config("grpo_tiny", words))

    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    inspected = subprocess.run(
        ["wandb", "leet", "inspect", str(log), "--json"], capture_output=True, check=True, timeout=120, text=True
    )
    records = [json.loads(line) for line in inspected.stdout.splitlines() if line.strip()]
    (run,) = [record["run"] for record in records if record["type"] == "run"]
    assert (run["project"], run["display_name"]) == ("trk", "e2")
    config = {key: value for key, value in run["config"]["update"].items() if key != "_wandb"}
    assert config == json.loads(json.dumps(expected_config))
    history = [record["history"]["item"] for record in records if record["type"] == "history"]
    metrics = {item["_step"]: item for item in history if "critic/score/mean" in item}
    assert sorted(metrics) == [1, 2]
    for row in rows:
        logged = metrics[row["step"]]
        numbers = {key: value for key, value in row.items() if key != "step" and value is not None}
        assert {key: logged[key] for key in numbers} == pytest.approx(numbers, rel=1e-6, abs=1e-9)
    tables = [item for item in history if "val/generations._type" in item]  # the reader flattens nested values
    assert [(item["_step"], item["val/generations._type"], item["val/generations.nrows"]) for item in tables] == [
        (0, "table-file", 2),
        (2, "table-file", 4),  # each validation adds its rows to the table
    ]
    table = json.loads((log.parent / "files" / tables[-1]["val/generations.path"]).read_text())
    assert table["columns"] == ["step", "input", "output", "score"]
    assert [row[0] for row in table["data"]] == [0, 0, 2, 2]

    read = subprocess.run(
        [sys.executable, "-c", READ_TRACKIO, "trk"], env=env, capture_output=True, check=True, timeout=120, text=True
    )
    trackio_run = json.loads(read.stdout.splitlines()[-1])
    assert trackio_run["name"] == "e2"
    assert trackio_run["config"]["data"]["train_batch_size"] == 4
    logged = {entry["step"]: entry for entry in trackio_run["logs"]}
    assert sorted(logged) == [1, 2]
    for row in rows:
        assert logged[row["step"]]["critic/score/mean"] == pytest.approx(row["critic/score/mean"], abs=1e-9)


@pytest.mark.slow  # two runs in processes of their own (~20 s)
def test_a_resumed_run_continues_the_same_offline_wandb_run_without_repeating_a_step(tiny_model, tmp_path):
    """Two steps, then a resume from the newest checkpoint up to step 3: the second offline run file holds the
    first one's run id (kept in the checkpoint, passed with resume="allow") and only step 3's metrics."""
    words = small_run(tiny_model, tmp_path) + ["trainer.logger=[wandb]", "trainer.test_freq=-1", "trainer.save_freq=1"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for steps in (2, 3):
        run_words = [*words, f"trainer.total_training_steps={steps}"]
        subprocess.run(
            [sys.executable, "-c", TRAIN_IN_PROCESS, json.dumps(run_words)], env=env, check=True, timeout=600
        )
    logged = []
    for log in sorted(
        (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda path: path.stat().st_mtime
    ):
        inspected = subprocess.run(
            ["wandb", "leet", "inspect", str(log), "--json"], capture_output=True, check=True, timeout=120, text=True
        )
        records = [json.loads(line) for line in inspected.stdout.splitlines() if line.strip()]
        (run,) = [record["run"] for record in records if record["type"] == "run"]
        steps = [record["history"]["item"]["_step"] for record in records if record["type"] == "history"]
        logged.append((run["run_id"], sorted(steps)))
    assert [steps for _, steps in logged] == [[1, 2], [3]]
    assert logged[0][0] == logged[1][0]
