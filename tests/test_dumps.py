"""Generation dumps on S3 (the moto server) and when writing them is slow or fails: the steps never wait."""

from __future__ import annotations

import time
import uuid

import pytest
from s3fs import S3FileSystem

from ppoflow.configs import load_config
from ppoflow.flows.cli import main
from ppoflow.flows.dumps import FAILURES, MAX_PENDING, GenerationDumper, read_dump
from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import train
from ppoflow.storage.fs import open_fs
from tests.conftest import S3_TEST_BUCKET, small_run
from tests.outage_proxy import OutageProxy


@pytest.fixture
def s3_endpoint(s3_server, monkeypatch):
    """``AWS_ENDPOINT_URL`` pointed at ``endpoint(moto's URL)``; s3fs's cached clients dropped before and after,
    so that each test's endpoint is the one its writes use."""

    def point_at(endpoint: str) -> None:
        S3FileSystem.clear_instance_cache()
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    yield s3_server[0], point_at
    S3FileSystem.clear_instance_cache()


def test_a_run_dumps_its_generations_to_s3(s3_endpoint, tiny_model, tmp_path, capsys):
    moto, point_at = s3_endpoint
    point_at(moto)
    root = f"s3://{S3_TEST_BUCKET}/dumps-{uuid.uuid4().hex[:8]}"
    words = small_run(tiny_model, tmp_path) + [f"trainer.rollout_data_dir={root}/rollouts"]
    words += [f"trainer.validation_data_dir={root}/val"]
    train(load_config("grpo_tiny", words), orchestrated=False)
    rows = read_metrics(str(tmp_path / "run"))
    assert [row[FAILURES] for row in rows] == [0.0, 0.0]
    fs, path = open_fs(root)
    assert sorted(name.removeprefix(f"{path}/") for name in fs.find(path)) == [
        "rollouts/1.jsonl",
        "rollouts/2.jsonl",
        "val/0.jsonl",
        "val/2.jsonl",
    ]  # one object per dump, nothing else (an S3 PUT is atomic: no temp objects)
    for row in rows:
        dumped = read_dump(f"{root}/rollouts", row["step"])
        assert len(dumped) == 16 and {line["step"] for line in dumped} == {row["step"]}
        assert sum(line["score"] for line in dumped) / 16 == pytest.approx(row["critic/score/mean"], abs=1e-6)
    capsys.readouterr()
    assert main(["dump", "show", f"{root}/rollouts", "--worst", "2"]) == 0  # the last step by default
    assert capsys.readouterr().out.startswith("step 2: the 2 lowest-scoring of 16 samples")


def test_a_stalled_bucket_holds_up_no_step_and_drops_what_it_cannot_take(s3_endpoint):
    """A bucket that accepts connections and never answers: every ``dump`` returns at once; past
    :data:`MAX_PENDING` waiting dumps the newer ones are dropped and counted. Once it answers again, the
    waiting dumps are written."""
    moto, point_at = s3_endpoint
    proxy = OutageProxy(int(moto.rsplit(":", 1)[1]))
    point_at(proxy.endpoint)
    root = f"s3://{S3_TEST_BUCKET}/stalled-{uuid.uuid4().hex[:8]}"
    dumper = GenerationDumper(tokenizer=None)
    try:
        proxy.switch("stall")
        started = time.monotonic()
        for step in range(1, MAX_PENDING + 3):
            dumper.dump(root, step, rows=[{"step": step, "input": "1>", "output": "1", "score": 1.0}])
        assert time.monotonic() - started < 5.0  # none waited for the bucket
        assert dumper.metrics() == {FAILURES: 2.0}  # the 9th and 10th: 8 were waiting
        proxy.switch("forward")  # cuts the hung connections: the writer retries them
        dumper.close()
    finally:
        proxy.close()
    assert dumper.metrics() == {FAILURES: 2.0}
    point_at(moto)
    assert [read_dump(root, step)[0]["step"] for step in range(1, MAX_PENDING + 1)] == list(range(1, MAX_PENDING + 1))


def test_a_failed_dump_write_warns_and_counts(tiny_model, tmp_path, caplog):
    (tmp_path / "a-file").write_text("not a directory")
    words = small_run(tiny_model, tmp_path) + [f"trainer.rollout_data_dir={tmp_path}/a-file/rollouts"]
    train(load_config("grpo_tiny", words), orchestrated=False)  # the run goes on
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[-1][FAILURES] >= 1.0  # step 1's failed write (the dumps are written while the next step runs)
    warned = [record.message for record in caplog.records if "could not write the generation dump" in record.message]
    assert len(warned) == 2 and all("a-file/rollouts" in message for message in warned)
