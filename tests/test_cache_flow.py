"""The step cache end to end: Prefect task-result caching of stages on local and S3 storage.

Each test trains a few tiny steps on the session's real Prefect server and local Ray, then looks at
the task runs Prefect recorded, the metrics, and the files under ``dump_dir``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from ppoflow.flows.cli import main as cli
from ppoflow.flows.tracking import read_metrics
from ppoflow.storage.step_cache import StepCache
from tests.flow_runs import (CONFIG, PROJECT, UPDATE_METRICS, cached_steps, copy_dump, rollout_skip,
                             small, train)

@pytest.fixture
def overrides(tiny_model, tmp_path):
    return small(tmp_path, tiny_model)


def test_the_golden_run_dumped_training_steps_only(golden):
    assert cached_steps(golden.dump) == [1, 2, 3, 4]  # validation ran at steps 0 and 4 and dumped nothing
    assert [row["skip/rollout/hit"] for row in golden.rows] == [0, 0, 0, 0]
    assert golden.states.count("Completed") == 4 + 2  # 4 training generations, 2 validation generations
    marker = (golden.dump / PROJECT / CONFIG / "1" / "meta.json").stat().st_size
    payload = (golden.dump / PROJECT / CONFIG / "1" / "rollout.safetensors").stat().st_size
    assert marker < 1500 < payload  # Prefect's record is the small manifest; tensors stay in the payload


def test_replay_is_prefect_cached_and_bit_identical(prefect_api, ray_local, golden, tmp_path):
    dump = copy_dump(golden, tmp_path)
    skip = {**golden.skip, "rollout.dump_dir": str(dump), "reward.dump_dir": str(dump), "rollout.steps": "[1,2,3,4]"}
    rows, states = train(golden.overrides, tmp_path / "run", 4, skip)
    assert states == ["Cached"] * 4
    assert [(row["skip/rollout/hit"], row["skip/rollout/load_step"]) for row in rows] == [(1, s) for s in (1, 2, 3, 4)]
    assert [row["skip/reward/hit"] for row in rows] == [1, 1, 1, 1]  # same input, so the reward replays too
    for before, after in zip(golden.rows, rows):
        for name in UPDATE_METRICS:
            assert before[name] == after[name], (name, before["step"])  # bit for bit


@pytest.mark.slow
def test_repeat_from_empty_dumps_the_first_step_and_reuses_it(prefect_api, ray_local, overrides, tmp_path):
    dump = tmp_path / "dump"
    rows, states = train(overrides, tmp_path / "run", 5, rollout_skip(dump, [1, 3, 5], "repeat"))
    hits = {row["step"]: (row.get("skip/rollout/hit"), row.get("skip/rollout/load_step")) for row in rows}
    assert hits == {1: (0, None), 2: (None, None), 3: (1, 1), 4: (None, None), 5: (1, 1)}
    assert states == ["Completed", "Completed", "Cached", "Completed", "Cached"]
    assert cached_steps(dump) == [1]


@pytest.mark.slow
def test_cache_with_only_step_one_present(prefect_api, ray_local, golden, tmp_path):
    dump = copy_dump(golden, tmp_path)
    for step in (2, 3, 4):
        shutil.rmtree(dump / PROJECT / CONFIG / str(step))
    rows, states = train(golden.overrides, tmp_path / "run", 5, rollout_skip(dump, [1, 3, 5]))
    assert [row.get("skip/rollout/hit") for row in rows] == [1, None, 0, None, 0]
    assert states[0] == "Cached" and states[2] == "Completed" and states[4] == "Completed"
    assert cached_steps(dump) == [1, 3, 5]


@pytest.mark.slow
def test_damaged_entries_are_regenerated_never_loaded(prefect_api, ray_local, golden, tmp_path, caplog):
    dump = copy_dump(golden, tmp_path)
    root = dump / PROJECT / CONFIG
    payload = (root / "1" / "rollout.safetensors")
    payload.write_bytes(payload.read_bytes()[:100])                      # 1: truncated payload
    (root / "2" / "meta.json").unlink()                                  # 2: marker missing (a crash)
    data = bytearray((root / "3" / "rollout.safetensors").read_bytes())
    data[-5:] = b"XXXXX"                                                 # 3: same size, wrong checksum
    (root / "3" / "rollout.safetensors").write_bytes(bytes(data))
    (root / "4" / "meta.json").write_text("{not json")                   # 4: garbage marker

    caplog.set_level("WARNING")
    rows, states = train(golden.overrides, tmp_path / "run", 4, rollout_skip(dump, [1, 2, 3, 4]))
    assert [row["skip/rollout/hit"] for row in rows] == [0, 0, 0, 0]
    assert states[0] == states[1] == states[3] == "Completed"
    assert "damaged" in caplog.text and str(root / "3") in caplog.text
    for before, after in zip(golden.rows, rows):  # regenerated exactly as the golden run generated them
        assert before["actor/pg_loss"] == after["actor/pg_loss"]
    assert all(StepCache(str(root)).status(step).valid for step in (1, 2, 3, 4))  # and dumped again


@pytest.mark.slow
def test_a_cache_of_another_shape_is_fitted_onto_the_prompts(prefect_api, ray_local, golden, tmp_path, caplog):
    """A step cached with n=4 replayed by a run with n=2 is a deliberate cross-config replay
    (``allow_mismatch``): fitted onto the prompts with verl's V1 uid remap, and the difference logged.
    Prefect has no record of the copied entry; its record is derived from the marker, so the generate
    task run is still ``Cached``."""
    dump = tmp_path / "dump"
    shutil.copytree(golden.dump / PROJECT / CONFIG / "1", dump / PROJECT / "GBS4_N2_in8_out3" / "1")
    caplog.set_level("WARNING")
    rows, states = train(golden.overrides + ["actor_rollout_ref.rollout.n=2"], tmp_path / "run", 1,
                         {**rollout_skip(dump, [1]), "rollout.allow_mismatch": "true"})
    assert rows[0]["skip/rollout/hit"] == 1 and states == ["Cached"]
    assert "sampling.n: 4 recorded, 2 here" in caplog.text and "replaying it anyway" in caplog.text
    assert "differ from n=2" in caplog.text


@pytest.mark.slow
def test_a_rollout_sampled_otherwise_is_not_replayed(prefect_api, ray_local, golden, tmp_path, caplog):
    """An entry sampled at another temperature, or from another model, is regenerated with a warning
    naming what differs."""
    dump = copy_dump(golden, tmp_path)
    other_model = tmp_path / "other_model"
    shutil.copytree(golden.overrides[0].split("=", 1)[1], other_model)
    weights = other_model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = bytes(byte ^ 0xFF for byte in data[-4:])  # another checkpoint: same files, other weights
    weights.write_bytes(bytes(data))
    caplog.set_level("WARNING")
    rows, _ = train(golden.overrides + ["actor_rollout_ref.rollout.temperature=0.7",
                                        f"actor_rollout_ref.model.path={other_model}"], tmp_path / "run", 1,
                    rollout_skip(dump, [1]))
    assert rows[0]["skip/rollout/hit"] == 0
    assert "sampling.temperature: 1.0 recorded, 0.7 here" in caplog.text and "model: 'sha256:" in caplog.text
    assert "recomputing" in caplog.text


@pytest.mark.slow
def test_reward_cache_is_reused_only_for_the_same_rollout(prefect_api, ray_local, golden, tmp_path, caplog):
    dump = copy_dump(golden, tmp_path)
    reward_only = {"reward.enable": "true", "reward.dump_dir": str(dump), "reward.steps": "[1]"}
    caplog.set_level("WARNING")
    rows, _ = train(golden.overrides + ["actor_rollout_ref.rollout.seed=7"], tmp_path / "run", 1, reward_only)
    assert rows[0]["skip/reward/hit"] == 0 and "does not match this run (input_fingerprint:" in caplog.text


@pytest.mark.slow
def test_s3_cache_replayed_by_a_fresh_process(prefect_api, ray_local, overrides, tmp_path, s3_server):
    endpoint, _ = s3_server
    skip = rollout_skip(f"s3://ppoflow-test/{uuid.uuid4().hex}", [1, 2])
    skip["rollout.storage_options"] = "{client_kwargs: {endpoint_url: '%s'}}" % endpoint
    first, _ = train(overrides, tmp_path / "run1", 2, skip)

    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    words = overrides + [f"trainer.default_local_dir={tmp_path}/run2", "trainer.total_training_steps=2",
                         "trainer.test_freq=-1"] + [f"skip.{key}={value}" for key, value in skip.items()]
    result = subprocess.run([sys.executable, "-m", "ppoflow.flows.cli", "train", *words], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    second = read_metrics(f"{tmp_path}/run2")
    assert [row["skip/rollout/hit"] for row in second] == [1, 1]
    assert [row["actor/pg_loss"] for row in second] == [row["actor/pg_loss"] for row in first]


def test_cache_cli_lists_shows_and_removes(golden, tmp_path, capsys):
    dump = copy_dump(golden, tmp_path)
    assert cli(["cache", "ls", str(dump)]) == 0
    listing = capsys.readouterr().out
    assert f"{PROJECT}" in listing and CONFIG in listing and "8 entries, 8 valid" in listing  # rollout + reward
    assert cli(["cache", "show", str(dump), "--step", "2", "--samples", "3"]) == 0
    shown = capsys.readouterr().out
    assert '"global_steps": 2' in shown and "prompt=" in shown and "reward=" in shown and shown.count("[") >= 3
    assert cli(["cache", "rm", str(dump), "--step", "1"]) == 0
    assert cached_steps(dump) == [2, 3, 4]
    assert not (dump / ".prefect" / PROJECT / CONFIG / "1" / "meta.json").exists()
    assert cli(["cache", "show", str(dump), "--step", "9"]) == 2
