"""Resume always finds the newest valid state in a damaged run directory: a torn ``metrics.jsonl`` line,
a corrupt newest checkpoint, stray entries, markers of the wrong shape, temp files of killed writes.

No Ray or Prefect: the checkpoints are written and loaded by a real actor worker in this process;
``tests/test_resume.py`` runs the same damage through a whole flow. One module checkpoint goes through the S3
server.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.checkpointing import restore_newest, save_checkpoint
from ppoflow.flows.state import TrainerState
from ppoflow.flows.tracking import Tracker, read_metrics
from ppoflow.storage import checkpoint
from ppoflow.storage.fs import STALE_TEMP_FILE_S, open_fs, remove_stale_temp_files
from ppoflow.workers.roles import LocalRole, Workers
from ppoflow.workers.training.policy import ActorWorker

pytestmark = pytest.mark.reliability

ROWS = [{"step": step, "critic/score/mean": step / 10} for step in (1, 2, 3)]
TORN = b'{"step": 4, "critic/sco'


def write_metrics(run_dir: Path, tail: bytes = TORN) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in ROWS) + tail)


# --- metrics.jsonl -------------------------------------------------------------------------------


def test_read_metrics_skips_a_torn_last_line_with_a_warning(tmp_path, caplog):
    write_metrics(tmp_path)
    assert read_metrics(str(tmp_path)) == ROWS
    assert "torn last line (line 4)" in caplog.text and "metrics.jsonl" in caplog.text


def test_read_metrics_refuses_a_damaged_line_before_the_last(tmp_path):
    write_metrics(tmp_path, tail=b"")
    lines = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_bytes(lines[0] + TORN + b"\n" + lines[2])
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a metrics row"):
        read_metrics(str(tmp_path))


def test_resuming_sets_the_torn_line_and_the_later_rows_aside(tmp_path, caplog):
    write_metrics(tmp_path)
    tracker = Tracker(str(tmp_path), [], total_steps=4, first_step=3)  # resumed from checkpoint 2
    assert read_metrics(str(tmp_path)) == ROWS[:2]
    (aside,) = tmp_path.glob("metrics.discarded-*.jsonl")
    assert aside.read_bytes() == json.dumps(ROWS[2]).encode() + b"\n" + TORN + b"\n"  # byte for byte
    assert f"set aside 2 line(s) of {tmp_path}/metrics.jsonl" in caplog.text and str(aside) in caplog.text
    tracker.log(3, {"critic/score/mean": 0.5})
    assert [row["step"] for row in read_metrics(str(tmp_path))] == [1, 2, 3]


def test_resuming_a_clean_metrics_file_sets_nothing_aside(tmp_path):
    write_metrics(tmp_path, tail=b"")
    Tracker(str(tmp_path), [], total_steps=4, first_step=4)
    assert read_metrics(str(tmp_path)) == ROWS
    assert not list(tmp_path.glob("metrics.discarded-*"))


# --- choosing among checkpoints -----------------------------------------------------------------


MALFORMED_MARKERS = {
    "not JSON": b"{",
    "not UTF-8": b"\xff\xfe",
    "nested too deeply": b"[" * 100_000,
    "a list": b"[]",
    "a string": b'"checkpoint"',
    "files is a list": json.dumps({"format_version": 1, "files": [], "global_step": 6}).encode(),
    "global_step is a string": json.dumps({"format_version": 1, "files": {}, "global_step": "6"}).encode(),
    "global_step is a bool": json.dumps({"format_version": 1, "files": {}, "global_step": True}).encode(),
    "entry is a number": json.dumps({"format_version": 1, "files": {"a": 3}, "global_step": 6}).encode(),
    "unsafe file name": json.dumps(
        {"format_version": 1, "global_step": 6, "files": {"../a": {"bytes": 0, "sha256": "0" * 64}}}
    ).encode(),
    "another version": json.dumps({"format_version": 2, "files": {}, "global_step": 6}).encode(),
}


@pytest.fixture
def run_with_one_good_checkpoint(tmp_path) -> tuple[Path, str]:
    run_dir = tmp_path / "run"
    return run_dir, checkpoint.commit(str(run_dir), 2, {}, {"global_step": 2})


@pytest.mark.parametrize("marker", list(MALFORMED_MARKERS.values()), ids=list(MALFORMED_MARKERS))
def test_markers_of_the_wrong_shape_are_skipped(run_with_one_good_checkpoint, marker, caplog):
    run_dir, good = run_with_one_good_checkpoint
    (run_dir / "global_step_6").mkdir()
    (run_dir / "global_step_6" / checkpoint.MARKER).write_bytes(marker)
    assert checkpoint.manifest(str(run_dir / "global_step_6")) is None
    assert checkpoint.complete_checkpoints(str(run_dir)) == [good]
    assert f"skipping checkpoint {run_dir}/global_step_6: damaged checkpoint.json" in caplog.text
    with pytest.raises(checkpoint.CheckpointError, match="not a complete checkpoint"):
        checkpoint.verify_checkpoint(str(run_dir / "global_step_6"))


def test_a_step_that_holds_only_the_exported_model_is_passed_over_silently(run_with_one_good_checkpoint, caplog):
    """A run without a checkpoint at its last step exports its policy to ``global_step_N/actor/huggingface``:
    no checkpoint was begun there, so nothing is named; anything more beside it is a save that did not finish."""
    run_dir, good = run_with_one_good_checkpoint
    export = Path(checkpoint.exported_model_url(str(run_dir), 6))
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"weights")
    assert checkpoint.latest(str(run_dir)) == good
    assert "skipping" not in caplog.text
    (export.parent / "model.safetensors").write_bytes(b"a shard of a save")
    assert checkpoint.latest(str(run_dir)) == good
    assert f"skipping checkpoint {run_dir}/global_step_6: no checkpoint.json (its save did not finish)" in caplog.text


def test_stray_entries_are_skipped(run_with_one_good_checkpoint, caplog):
    run_dir, good = run_with_one_good_checkpoint
    older = checkpoint.commit(str(run_dir), 1, {}, {"global_step": 1})
    (run_dir / "global_step_5").write_text("not a directory")
    (run_dir / "global_step_7").mkdir()
    (run_dir / "global_step_7" / checkpoint.MARKER).mkdir()  # a directory where the marker belongs
    checkpoint.commit(str(run_dir), 8, {}, {"global_step": 8})
    (run_dir / "global_step_8").rename(run_dir / "global_step_08")  # not step_url's spelling of step 8
    checkpoint.commit(str(run_dir), 9, {}, {"global_step": 9})
    (run_dir / "global_step_9").rename(run_dir / "global_step_10")  # its marker records another step
    assert checkpoint.complete_checkpoints(str(run_dir)) == [good, older]
    assert checkpoint.latest(str(run_dir)) == good
    assert f"skipping checkpoint {run_dir}/global_step_7: unreadable checkpoint.json" in caplog.text
    assert f"skipping checkpoint {run_dir}/global_step_10: its checkpoint.json records global_step 9" in caplog.text
    assert checkpoint.complete_checkpoints(str(run_dir / "absent")) == []


# --- loading, with fallback ---------------------------------------------------------------------


@pytest.fixture
def actor_run(tiny_overrides, tmp_path):
    """A config, its actor worker (in this process) and checkpoints 1 and 2 of different weights;
    returns (overrides, workers, weights at step 1, weights at step 2)."""
    overrides = [*tiny_overrides, f"trainer.default_local_dir={tmp_path}/run"]
    cfg = load_config("grpo_tiny", overrides)
    actor = ActorWorker(cfg)
    workers = Workers(rollout=None, actor=LocalRole(actor), uses_ray=False)
    states = {}
    for step in (1, 2):
        with torch.no_grad():
            next(actor.model.parameters()).add_(1.0)
        states[step] = {name: tensor.clone() for name, tensor in actor.model.state_dict().items()}
        trainer = TrainerState(cfg, 12).state_dict() | {"weight_version": step}
        save_checkpoint(cfg, workers, step, {"trainer": trainer, "mode": {"in_flight": {}}})
    with torch.no_grad():
        next(actor.model.parameters()).add_(1.0)  # the workers now hold neither checkpoint's weights
    return overrides, workers, states[1], states[2]


def flip_bytes(path: Path) -> None:
    """Damage a file without changing its size (only the sha256 can tell)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes(255 - byte for byte in data[len(data) // 2 : len(data) // 2 + 8])
    path.write_bytes(bytes(data))


def assert_holds(workers: Workers, weights: dict) -> None:
    for name, tensor in workers.actor.worker.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(actor_run, tmp_path, caplog):
    overrides, workers, step_1, _ = actor_run
    flip_bytes(tmp_path / "run" / "global_step_2" / "actor" / "model.safetensors")
    restored = restore_newest(load_config("grpo_tiny", overrides), workers)
    assert (restored.directory, restored.step) == (f"{tmp_path}/run/global_step_1", 1)
    assert restored.parts["trainer"]["weight_version"] == 1
    assert_holds(workers, step_1)
    assert workers.actor.worker.weight_version == 1
    warning = f"not resuming from checkpoint {tmp_path}/run/global_step_2: "
    assert warning in caplog.text and "model.safetensors: checksum" in caplog.text


DAMAGE = {
    "a missing weights file": ("actor/model.safetensors", None, "missing actor/model.safetensors"),
    "a truncated optimizer file": ("actor/optimizer.pt", b"short", "actor/optimizer.pt has 5 bytes"),
    "a damaged marker": ("checkpoint.json", b'{"format_version": 1, "files": {', "damaged checkpoint.json"),
    "no marker (a save that did not finish)": ("checkpoint.json", None, "no checkpoint.json"),
}


@pytest.mark.parametrize("name, content, reason", list(DAMAGE.values()), ids=list(DAMAGE))
def test_an_incomplete_newest_checkpoint_is_named_with_why_and_the_older_one_loads(
    actor_run, tmp_path, caplog, name, content, reason
):
    overrides, workers, step_1, _ = actor_run
    damaged = tmp_path / "run" / "global_step_2" / name
    if content is None:
        damaged.unlink()
    else:
        damaged.write_bytes(content)
    restored = restore_newest(load_config("grpo_tiny", overrides), workers)
    assert (restored.directory, restored.step) == (f"{tmp_path}/run/global_step_1", 1)
    assert_holds(workers, step_1)
    assert f"skipping checkpoint {tmp_path}/run/global_step_2: {reason}" in caplog.text


def test_a_checkpoint_of_another_model_falls_back_too(actor_run, tmp_path, caplog):
    overrides, workers, _, step_2 = actor_run
    other = checkpoint.save_module(f"{tmp_path}/run/global_step_3/actor", torch.nn.Linear(2, 2).state_dict(), {})
    checkpoint.commit(
        f"{tmp_path}/run",
        3,
        {f"actor/{name}": entry for name, entry in other.items()},
        {"global_step": 3, "trainer": {"weight_version": 3}, "mode": {}},
    )
    assert restore_newest(load_config("grpo_tiny", overrides), workers).step == 2
    assert_holds(workers, step_2)
    assert "global_step_3/actor: weights do not fit the model" in caplog.text


def test_a_damaged_resume_path_is_a_config_error_and_loads_nothing(actor_run, tmp_path):
    overrides, workers, _, _ = actor_run
    before = {name: tensor.clone() for name, tensor in workers.actor.worker.model.state_dict().items()}
    flip_bytes(tmp_path / "run" / "global_step_2" / "actor" / "optimizer.pt")  # read after the weights
    cfg = load_config(
        "grpo_tiny",
        [*overrides, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path}/run/global_step_2"],
    )
    with pytest.raises(ConfigError, match="trainer.resume_from_path: cannot resume from .*optimizer.pt: checksum"):
        restore_newest(cfg, workers)
    assert_holds(workers, before)  # verified before loading: the weights were not touched


def test_when_no_checkpoint_loads_the_run_does_not_start_over(actor_run, tmp_path):
    overrides, workers, _, _ = actor_run
    for step in (1, 2):
        flip_bytes(tmp_path / "run" / f"global_step_{step}" / "trainer_state.json")
    with pytest.raises(
        ConfigError, match="trainer.default_local_dir: no checkpoint in .* can be loaded .*trainer.resume_mode=disable"
    ):
        restore_newest(load_config("grpo_tiny", overrides), workers)
    assert restore_newest(load_config("grpo_tiny", [*overrides, "trainer.resume_mode=disable"]), workers) is None


# --- temp files of interrupted writes -----------------------------------------------------------


def test_stale_temp_files_are_removed_and_fresh_ones_kept(tmp_path):
    actor = tmp_path / "run" / "global_step_1" / "actor"
    actor.mkdir(parents=True)
    stale = actor / f".model.safetensors.{'a' * 32}.tmp"
    fresh = actor / f".optimizer.pt.{'b' * 32}.tmp"  # a write that may still be going on
    foreign = actor / ".notes.tmp"  # not a name atomic_write gives
    for path in (stale, fresh, foreign):
        path.write_bytes(b"partial")
    long_ago = time.time() - 2 * STALE_TEMP_FILE_S
    for path in (stale, foreign):
        os.utime(path, (long_ago, long_ago))
    assert remove_stale_temp_files(*open_fs(str(tmp_path / "run")), older_than_s=STALE_TEMP_FILE_S) == [str(stale)]
    assert not stale.exists() and fresh.exists() and foreign.exists()


def test_resuming_removes_stale_temp_files_of_the_run(tiny_overrides, tmp_path):
    stale = tmp_path / "run" / f".metrics.jsonl.{'c' * 32}.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"partial")
    long_ago = time.time() - 2 * STALE_TEMP_FILE_S
    os.utime(stale, (long_ago, long_ago))
    cfg = load_config("grpo_tiny", [*tiny_overrides, f"trainer.default_local_dir={tmp_path}/run"])
    assert restore_newest(cfg, Workers(rollout=None, actor=None, uses_ray=False)) is None  # nothing to resume
    assert not stale.exists()


def test_a_module_checkpoint_round_trips_through_s3(s3_server, monkeypatch):
    """Weights and optimizer state written to a real S3 server (the optimizer state from its in-memory buffer, a
    memoryview, which the PUT takes as bytes) read back checked against the entries' sizes and checksums."""
    import uuid

    from tests.conftest import S3_TEST_BUCKET

    endpoint, _ = s3_server
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    directory = f"s3://{S3_TEST_BUCKET}/{uuid.uuid4().hex}/actor"
    entries = checkpoint.save_module(directory, layer.state_dict(), optimizer.state_dict())
    shapes = {name: tensor.shape for name, tensor in layer.state_dict().items()}
    weights, state = checkpoint.load_module(directory, entries, shapes)
    assert all(torch.equal(weights[name], tensor) for name, tensor in layer.state_dict().items())
    saved = optimizer.state_dict()["state"][0]
    assert all(torch.equal(state["state"][0][key], saved[key]) for key in ("exp_avg", "exp_avg_sq"))
