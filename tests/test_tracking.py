"""Where metrics go: metrics.jsonl (kept across runs), TensorBoard events, and fsspec model paths."""

import fsspec
import torch

from ppoflow.flows.tracking import Tracker, read_metrics
from ppoflow.workers.models import load_causal_lm, load_tokenizer
from tests.conftest import model_config


def test_metrics_jsonl_and_tensorboard(tmp_path):
    tracker = Tracker(str(tmp_path / "run"), ["tensorboard"], total_steps=2)
    tracker.log(1, {"critic/score/mean": 0.25, "actor/pg_loss": float("nan")})
    tracker.log(2, {"critic/score/mean": 0.5})
    tracker.close()
    assert read_metrics(str(tmp_path / "run")) == [
        {"step": 1, "actor/pg_loss": None, "critic/score/mean": 0.25},
        {"step": 2, "critic/score/mean": 0.5},
    ]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))

    again = Tracker(str(tmp_path / "run"), [], total_steps=1)  # a new run of the same experiment
    again.log(1, {"critic/score/mean": 1.0})
    assert [row["critic/score/mean"] for row in read_metrics(str(tmp_path / "run"))] == [1.0]
    assert len(list((tmp_path / "run").glob("metrics-*.jsonl"))) == 1  # the earlier rows are kept aside


def test_models_load_from_an_fsspec_url(tiny_model):
    fs = fsspec.filesystem("memory")
    for path in fsspec.filesystem("file").ls(tiny_model):
        fs.pipe_file(f"/models/tiny/{path.rsplit('/', 1)[-1]}", open(path, "rb").read())
    remote = model_config("memory://models/tiny")
    local = model_config(tiny_model)
    assert load_tokenizer(remote)("12>")["input_ids"] == load_tokenizer(local)("12>")["input_ids"]
    for (name, a), (_, b) in zip(
        load_causal_lm(remote).state_dict().items(), load_causal_lm(local).state_dict().items()
    ):
        assert torch.equal(a, b), name
