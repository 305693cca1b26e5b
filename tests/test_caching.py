"""The pieces of stage caching that need no server: records, the checks a replay's record read makes, the
dump hook, fingerprints, and the run's cache report lines."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from prefect.results import ResultStore
from tensordict import TensorDict

from ppoflow.flows.cache_report import CacheReport, Elsewhere, config_differences
from ppoflow.flows.cached_stages.calls import ReplayOnly, StepDump, dumping
from ppoflow.flows.cached_stages.planning import OUTCOMES, StepOutcome
from ppoflow.flows.cached_stages.records import DerivedRecords, ManifestSerializer, StepCacheStorage
from ppoflow.storage.batch import StageResult, with_non_tensor_columns
from ppoflow.storage.fingerprints import batch_fingerprint
from ppoflow.storage.step_cache import CacheWriteError, StepCache
from ppoflow.storage.step_cache.entry_check import CacheEntryRejected, EntryCheck, StageRecord
from ppoflow.storage.step_cache.store import encode_manifest
from ppoflow.tasks.task_inputs import recorded_task


def sample_batch(uid: str = "u", rows: int = 2, fill: int = 1) -> TensorDict:
    batch = TensorDict(
        {"responses": torch.full((rows, 3), fill), "response_mask": torch.ones(rows, 3, dtype=torch.bool)},
        batch_size=[rows],
    )
    return with_non_tensor_columns(
        batch, {"uid": [uid] * rows, "data_source": ["d"] * rows, "ground_truth": ["1"] * rows}
    )


def test_manifest_serializer_writes_only_the_manifest_and_refuses_a_failed_dump(tmp_path):
    cache = StepCache(str(tmp_path / "root"))
    manifest = cache.write_payload(3, sample_batch())
    serializer = ManifestSerializer()
    blob = serializer.dumps(StageRecord(sample_batch(), {}, manifest))
    assert blob == encode_manifest(manifest)  # the marker bytes, no tensors
    back = serializer.loads(blob)
    assert back.fields is None and back.manifest == manifest
    with pytest.raises(ValueError, match="no cache entry"):
        serializer.dumps(StageRecord(sample_batch(), {}, None))


def test_fingerprint_depends_on_values_not_on_layout():
    batch = sample_batch()
    reordered = TensorDict(
        {"response_mask": batch["response_mask"], "responses": batch["responses"].clone()}, batch_size=[2]
    )
    assert batch_fingerprint(batch) == batch_fingerprint(reordered)  # field order and the uid column do not matter
    changed = sample_batch(fill=2)
    assert batch_fingerprint(batch) != batch_fingerprint(changed)
    assert batch_fingerprint(batch, weights="a") != batch_fingerprint(batch, weights="b")


def test_a_dump_records_the_metrics_and_a_failed_write_is_a_metric(tmp_path, monkeypatch, caplog):
    cache = StepCache(str(tmp_path / "root"), stage="reward", write_retries=1, retry_backoff_s=0)
    record = StepDump(cache, 2, {"input_fingerprint": "x"}, timeout_s=30).write(
        StageResult(sample_batch(), {"reward/x/mean": 0.5})
    )
    assert record.manifest["metrics"] == {"reward/x/mean": 0.5} and record.manifest["input_fingerprint"] == "x"

    def refuse(*args, **kwargs):
        raise CacheWriteError("somewhere", "refused")

    monkeypatch.setattr(cache, "write_payload", refuse)
    caplog.set_level(logging.WARNING)
    record = StepDump(cache, 4, {}, timeout_s=30).write(StageResult(sample_batch(), {"reward/x/mean": 0.5}))
    assert record.manifest is None and record.metrics == {"reward/x/mean": 0.5, "skip/reward/dump_failed": 1.0}
    assert "could not cache reward of step 4" in caplog.text


def test_dumping_adds_the_dump_keyword_and_leaves_the_stage_task_alone(tmp_path):
    calls = []

    @recorded_task(name="stage")
    def stage(batch: TensorDict, scale: int = 1) -> StageResult:
        calls.append(scale)
        return StageResult(batch, {"m": float(scale)})

    dumps = dumping(stage)
    assert list(inspect.signature(dumps.fn).parameters) == ["batch", "scale", "dump"]
    assert list(inspect.signature(stage.fn).parameters) == ["batch", "scale"]  # the task itself is untouched
    assert (dumps.name, dumps.task_key) == (stage.name, stage.task_key)
    plain = stage.fn(sample_batch(), scale=2)
    assert type(plain) is StageResult and plain.metrics == {"m": 2.0}
    cache = StepCache(str(tmp_path / "root"))
    dumped = dumps.fn(sample_batch(), 3, dump=StepDump(cache, 1, {}, timeout_s=30))
    assert isinstance(dumped, StageRecord) and dumped.manifest["metrics"] == {"m": 3.0}
    assert calls == [2, 3] and not cache.status(1).valid  # payload only: Prefect commits the marker


def replay_store(dump, check: EntryCheck) -> ResultStore:
    """The result store a replay's task run reads its record through."""
    return ResultStore(
        result_storage=StepCacheStorage(basepath=str(dump)),
        metadata_storage=DerivedRecords(basepath=str(dump), check=check),
        serializer=ManifestSerializer(),
        cache_result_in_memory=False,
    )


def test_reading_a_replays_record_loads_and_checks_the_entry(tmp_path, caplog):
    """What Prefect reads before it calls a replay Cached is the whole entry, checked: a good one comes back
    with its tensors; a flipped byte, another input, or another identity (unless allowed) raise
    CacheEntryRejected naming why."""
    root = tmp_path / "exp_proj" / "GBS1_N2_in3_out3"
    StepCache(str(root)).write(1, sample_batch(fill=7), meta={"input_fingerprint": "x", "sampling": {"n": 2}})
    key = "exp_proj/GBS1_N2_in3_out3/1/meta.json"
    check = EntryCheck(
        root=str(root), stage="rollout", step=1, requires={"input_fingerprint": "x"}, identity={"sampling": {"n": 2}}
    )
    record = replay_store(tmp_path, check).read(key).result
    assert isinstance(record, StageRecord) and record.manifest["global_steps"] == 1
    assert record.fields["responses"].tolist() == [[7, 7, 7]] * 2

    other_input = check.model_copy(update={"requires": {"input_fingerprint": "y"}})
    with pytest.raises(CacheEntryRejected, match=r"does not match this run \(input_fingerprint: 'x' recorded, 'y'"):
        replay_store(tmp_path, other_input).read(key)
    other_n = check.model_copy(update={"identity": {"sampling": {"n": 4}}})
    with pytest.raises(CacheEntryRejected, match="sampling.n: 2 recorded, 4 here"):
        replay_store(tmp_path, other_n).read(key)
    caplog.set_level(logging.WARNING)
    allowed = replay_store(tmp_path, other_n.model_copy(update={"allow_mismatch": True})).read(key).result
    assert allowed.fields is not None and "replaying it anyway (skip.rollout.allow_mismatch)" in caplog.text

    payload = root / "1" / "rollout.safetensors"
    data = bytearray(payload.read_bytes())
    data[-2] ^= 0x01  # one bit: same size, so only the checksum can tell
    payload.write_bytes(bytes(data))
    store = replay_store(tmp_path, check)
    assert store.exists(key)  # the marker is valid: Prefect would go on to read the record...
    with pytest.raises(CacheEntryRejected, match=r"cached rollout of step 1 is damaged \(.*checksum") as rejected:
        store.read(key)  # ...and the read refuses it, before any Cached state
    assert str(payload) in rejected.value.reason and rejected.value.reason in caplog.text


def test_a_replays_body_refuses_instead_of_computing(tmp_path):
    """When Prefect finds no valid record to replay and runs the body, the body names why and computes nothing."""
    calls = []

    @recorded_task(name="stage")
    def stage(batch: TensorDict) -> StageResult:
        calls.append(batch)
        return StageResult(batch, {})

    cache = StepCache(str(tmp_path / "root"))
    cache.write(2, sample_batch())
    (tmp_path / "root" / "2" / "meta.json").write_text("{not json")
    with pytest.raises(CacheEntryRejected, match=r"no valid rollout cache entry to replay at .*/2 \(unreadable meta"):
        dumping(stage).fn(sample_batch(), dump=ReplayOnly(cache, 2))
    assert calls == []


def test_config_differences_name_the_keys_of_the_directory_name():
    here = "grpo_tiny_ppoflow/GBS4_N4_in8_out3"
    differences = {
        there: config_differences(here, there, experiment="grpo_tiny", project="ppoflow")
        for there in ("other_ppoflow/GBS4_N4_in8_out3", "grpo_tiny_proj/GBS8_N4_in8_out5", "x_y/custom")
    }
    assert differences == {
        "other_ppoflow/GBS4_N4_in8_out3": ["trainer.experiment_name is 'other' there, 'grpo_tiny' here"],
        "grpo_tiny_proj/GBS8_N4_in8_out5": [
            "trainer.project_name is 'proj' there, 'ppoflow' here",
            "data.gen_batch_size is 8 there, 4 here",
            "data.max_response_length is 5 there, 3 here",
        ],
        "x_y/custom": [
            "trainer.experiment_name and project_name make 'x_y' there, 'grpo_tiny_ppoflow' here",
            "the shape is 'custom' there, 'GBS4_N4_in8_out3' here",
        ],
    }


def test_the_cache_report_lines():
    outcomes = {outcome: [] for outcome in OUTCOMES}
    outcomes["replayed"] = [StepOutcome(1, "replayed"), StepOutcome(3, "replayed", "the entry of step 1")]
    outcomes["rejected"] = [StepOutcome(2, "rejected", "cached rollout of step 2 is damaged (x: checksum)")]
    outcomes["missing"] = [StepOutcome(4, "missing"), StepOutcome(5, "missing")]
    found = CacheReport("rollout", outcomes, [])
    assert found.planned == 5 and found.needs_attention
    assert found.line() == (
        "replayed 2 of 5 planned steps of rollout: 1 rejected (step 2: cached rollout of step 2 "
        "is damaged (x: checksum)), 2 missing (no entry to replay: computed and written)"
    )
    assert found.markdown() == [
        "- replayed 2 of 5 planned steps of rollout (`skip.rollout`), 1 rejected, 2 missing",
        "  - step 2 rejected: cached rollout of step 2 is damaged (x: checksum)",
        "  - missing: no entry to replay: computed and written",
    ]

    missing = [StepOutcome(1, "missing"), StepOutcome(2, "missing")]
    recording = CacheReport("reward", {**{o: [] for o in OUTCOMES}, "missing": missing}, [])
    assert not recording.needs_attention  # a first run writes what later runs replay: nothing to act on
    elsewhere = CacheReport(
        "rollout",
        recording.outcomes,
        [Elsewhere("other_ppoflow/GBS4_N4_in8_out3", [1], ["trainer.experiment_name is 'other' there, 'x' here"])],
    )
    assert elsewhere.needs_attention and elsewhere.line() == (
        "replayed 0 of 2 planned steps of rollout: 2 missing (no entry under this run's configuration; the cache "
        "holds step 1 under other_ppoflow/GBS4_N4_in8_out3, where trainer.experiment_name is 'other' there, 'x' here)"
    )
