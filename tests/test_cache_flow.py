"""The step cache end to end: Prefect task-result caching of stages on local and S3 storage.

Each test trains a few tiny steps on the session's real Prefect server and local Ray, then looks at
the task runs Prefect recorded, the metrics, and the files under ``dump_dir``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest

from ppoflow.flows.cache_report import report
from ppoflow.flows.cached_stages.planning import stage_caches
from ppoflow.flows.cli import main as cli
from ppoflow.flows.tracking import read_metrics
from ppoflow.storage.step_cache import StepCache
from tests.conftest import drain_prefect_logs
from tests.flow_runs import (
    CONFIG,
    PROJECT,
    UPDATE_METRICS,
    cached_steps,
    copy_dump,
    generate_states,
    rollout_skip,
    small,
    train,
    train_run,
)
from tests.preflight_helpers import DEMO_TRAIN


@pytest.fixture
def overrides(tiny_model, tmp_path):
    return small(tmp_path, tiny_model)


def task_runs_named(flow_run_id, name: str, expected: int) -> list:
    """The flow run's task runs named ``name``, in start order, once ``expected`` of them are recorded final."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = [
                run
                for run in client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                    task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[name])),
                    sort=TaskRunSort.EXPECTED_START_TIME_ASC,
                )
                if run.state and run.state.is_final()
            ]
            if len(runs) >= expected:
                return runs
            assert time.monotonic() < deadline, f"{len(runs)} of {expected} {name} task runs recorded"
            time.sleep(0.5)


def task_run_log(task_run_id, needle: str) -> str:
    """The task run's logs, once one holds ``needle``."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    drain_prefect_logs()
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            text = "\n".join(
                log.message
                for log in client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
            )
            if needle in text or time.monotonic() > deadline:
                return text
            time.sleep(0.5)


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
def test_two_colocated_ranks_record_and_replay_their_steps(prefect_api, ray_local, overrides, tmp_path):
    """Steps that two colocated ranks generated (each rank its share) are recorded and replayed as any others:
    Cached, and the updates bit for bit."""
    ranks = overrides + [
        "trainer.n_cpu_ranks_per_node=2",
        "actor_rollout_ref.hybrid_engine=true",
        "actor_rollout_ref.actor.resources.num_cpus=0.5",
    ]
    dump = tmp_path / "dump"
    recorded, states = train(ranks, tmp_path / "recorded", 2, rollout_skip(dump, [1, 2]))
    assert states == ["Completed", "Completed"] and cached_steps(dump) == [1, 2]
    replayed, states = train(ranks, tmp_path / "replayed", 2, rollout_skip(dump, [1, 2]))
    assert states == ["Cached", "Cached"] and [row["skip/rollout/hit"] for row in replayed] == [1, 1]
    for before, after in zip(recorded, replayed):
        for name in UPDATE_METRICS:
            assert before[name] == after[name], (name, before["step"])


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
    payload = root / "1" / "rollout.safetensors"
    payload.write_bytes(payload.read_bytes()[:100])  # 1: truncated payload
    (root / "2" / "meta.json").unlink()  # 2: marker missing (a crash)
    data = bytearray((root / "3" / "rollout.safetensors").read_bytes())
    data[-5:] = b"XXXXX"  # 3: same size, wrong checksum
    (root / "3" / "rollout.safetensors").write_bytes(bytes(data))
    (root / "4" / "meta.json").write_text("{not json")  # 4: garbage marker

    caplog.set_level("WARNING")
    rows, _, flow_run_id = train_run(golden.overrides, tmp_path / "run", 4, rollout_skip(dump, [1, 2, 3, 4]))
    assert [row["skip/rollout/hit"] for row in rows] == [0, 0, 0, 0]
    # a committed entry (1, 3, 4) is a rejected replay, then generated; an uncommitted one (2) is just generated
    assert [row.get("skip/rollout/rejected") for row in rows] == [1, None, 1, 1]
    assert generate_states(flow_run_id, 7) == ["Failed", "Completed", "Completed"] + ["Failed", "Completed"] * 2
    assert "damaged" in caplog.text and str(root / "3") in caplog.text
    for before, after in zip(golden.rows, rows):  # regenerated exactly as the golden run generated them
        assert before["actor/pg_loss"] == after["actor/pg_loss"]
    assert all(StepCache(str(root)).status(step).valid for step in (1, 2, 3, 4))  # and dumped again


@pytest.mark.slow  # two replays (~10 s); a poisoned entry regenerates by default in test_cache_security
def test_a_rejected_entry_is_a_failed_task_run_saying_why(prefect_api, ray_local, golden, tmp_path, caplog):
    """A rollout entry with one bit flipped, and a reward entry computed from another batch: each replay's
    task run is Failed (never Cached) and its logs say why, the stage then runs again as a Completed task run
    and is dumped; a good entry is still Cached with its key. The run's end says what was replayed."""
    dump = copy_dump(golden, tmp_path)
    root = dump / PROJECT / CONFIG
    payload = root / "2" / "rollout.safetensors"
    data = bytearray(payload.read_bytes())
    data[-3] ^= 0x01
    payload.write_bytes(bytes(data))
    # the seed is not part of how a rollout was sampled, so step 1 replays; step 2, regenerated with seed 7,
    # gives the reward another input than the one its entry was computed from
    skip = {**rollout_skip(dump, [1, 2]), "reward.enable": "true", "reward.dump_dir": str(dump), "reward.steps": "[2]"}
    caplog.set_level("INFO", logger="ppoflow.flows.cache_report")
    rows, _, flow_run_id = train_run(golden.overrides + ["actor_rollout_ref.rollout.seed=7"], tmp_path / "run", 2, skip)

    assert [(row["skip/rollout/hit"], row.get("skip/rollout/rejected")) for row in rows] == [(1, None), (0, 1)]
    assert rows[1]["skip/reward/hit"] == 0 and rows[1]["skip/reward/rejected"] == 1
    (replayed,) = task_runs_named(flow_run_id, "generate[step=1]", 1)
    assert replayed.state.name == "Cached" and replayed.cache_key == f"{PROJECT}/{CONFIG}/1/meta.json"
    for name, reason in (
        ("generate[step=2]", "cached rollout of step 2 is damaged"),
        ("reward[step=2]", "cached reward of step 2 does not match this run (input_fingerprint:"),
    ):
        rejected, recomputed = task_runs_named(flow_run_id, name, 2)
        assert (rejected.state.type.value, recomputed.state.name) == ("FAILED", "Completed"), name
        assert "CacheEntryRejected" in rejected.state.message and reason in rejected.state.message
        assert reason in task_run_log(rejected.id, reason)
    assert StepCache(str(root)).status(2).valid and StepCache(str(root), stage="reward").status(2).valid
    assert (
        "step cache: replayed 1 of 2 planned steps of rollout: 1 rejected (step 2: cached rollout of step 2 "
        "is damaged" in caplog.text
    )
    assert "step cache: replayed 0 of 1 planned steps of reward: 1 rejected (step 2: cached reward" in caplog.text


def test_missing_entries_kept_under_another_experiment_are_named(prefect_api, golden, tmp_path):
    """A replay under another experiment name finds nothing in its own configuration directory: the report
    says where the cache holds those steps, and which config key differs."""
    from ppoflow.configs import load_config

    dump = copy_dump(golden, tmp_path)
    skip = [f"skip.{key}={value}" for key, value in rollout_skip(dump, [1, 2, 9]).items()]
    cfg = load_config("grpo_tiny", golden.overrides + skip + ["trainer.experiment_name=other", "trainer.test_freq=-1"])
    (cache,) = stage_caches(cfg).values()
    for step in (1, 2, 9):
        assert not cache.plan(step).hit_expected  # nothing under this experiment's own directory
        cache.note(step, "missing")
    found = report(cache, cfg)
    assert [outcome.step for outcome in found.outcomes["missing"]] == [1, 2, 9]
    assert found.needs_attention and found.line() == (
        "replayed 0 of 3 planned steps of rollout: 3 missing (no entry under this run's configuration; the cache "
        f"holds steps 1, 2 under {PROJECT}/{CONFIG}, where trainer.experiment_name is 'grpo_tiny' there, 'other' "
        "here)"
    )


@pytest.mark.slow
def test_a_cache_of_another_shape_is_fitted_onto_the_prompts(prefect_api, ray_local, golden, tmp_path, caplog):
    """A step cached with n=4 replayed by a run with n=2 is a deliberate cross-config replay
    (``allow_mismatch``): fitted onto the prompts with verl's V1 uid remap, and the difference logged.
    Prefect has no record of the copied entry; its record is derived from the marker, so the generate
    task run is still ``Cached``."""
    dump = tmp_path / "dump"
    shutil.copytree(golden.dump / PROJECT / CONFIG / "1", dump / PROJECT / "GBS4_N2_in8_out3" / "1")
    caplog.set_level("WARNING")
    rows, states = train(
        golden.overrides + ["actor_rollout_ref.rollout.n=2"],
        tmp_path / "run",
        1,
        {**rollout_skip(dump, [1]), "rollout.allow_mismatch": "true"},
    )
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
    rows, _ = train(
        golden.overrides + ["actor_rollout_ref.rollout.temperature=0.7", f"actor_rollout_ref.model.path={other_model}"],
        tmp_path / "run",
        1,
        rollout_skip(dump, [1]),
    )
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
    skip["rollout.storage_options"] = f"{{client_kwargs: {{endpoint_url: '{endpoint}'}}}}"
    first, _ = train(overrides, tmp_path / "run1", 2, skip)

    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}
    words = (
        overrides
        + [f"trainer.default_local_dir={tmp_path}/run2", "trainer.total_training_steps=2", "trainer.test_freq=-1"]
        + [f"skip.{key}={value}" for key, value in skip.items()]
    )
    result = subprocess.run(
        [*DEMO_TRAIN, *words],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
