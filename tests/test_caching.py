"""The pieces of stage caching that need no server: records, the dump hook and fingerprints."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from tensordict import TensorDict

from ppoflow.storage.batch import StageResult, with_non_tensor_columns
from ppoflow.storage.step_cache import CacheWriteError, StepCache
from ppoflow.storage.step_cache.stage_cache import StepDump, cacheable, fingerprint
from ppoflow.storage.step_cache.prefect import ManifestSerializer, StageRecord
from ppoflow.storage.step_cache.store import encode_manifest


def sample_batch(uid: str = "u", rows: int = 2, fill: int = 1) -> TensorDict:
    batch = TensorDict({"responses": torch.full((rows, 3), fill), "response_mask": torch.ones(rows, 3, dtype=torch.bool)},
                       batch_size=[rows])
    return with_non_tensor_columns(batch, {"uid": [uid] * rows, "data_source": ["d"] * rows,
                                           "ground_truth": ["1"] * rows})


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
    reordered = TensorDict({"response_mask": batch["response_mask"], "responses": batch["responses"].clone()},
                           batch_size=[2])
    assert fingerprint(batch) == fingerprint(reordered)  # field order and the uid column do not matter
    changed = sample_batch(fill=2)
    assert fingerprint(batch) != fingerprint(changed)
    assert fingerprint(batch, weights="a") != fingerprint(batch, weights="b")


def test_a_dump_records_the_metrics_and_a_failed_write_is_a_metric(tmp_path, monkeypatch, caplog):
    cache = StepCache(str(tmp_path / "root"), stage="reward", write_retries=1, retry_backoff_s=0)
    record = StepDump(cache, 2, {"input_fingerprint": "x"}, timeout_s=30).write(StageResult(sample_batch(), {"reward/x/mean": 0.5}))
    assert record.manifest["metrics"] == {"reward/x/mean": 0.5} and record.manifest["input_fingerprint"] == "x"

    def refuse(*args, **kwargs):
        raise CacheWriteError("somewhere", "refused")

    monkeypatch.setattr(cache, "write_payload", refuse)
    caplog.set_level(logging.WARNING)
    record = StepDump(cache, 4, {}, timeout_s=30).write(StageResult(sample_batch(), {"reward/x/mean": 0.5}))
    assert record.manifest is None and record.metrics == {"reward/x/mean": 0.5, "skip/reward/dump_failed": 1.0}
    assert "could not cache reward of step 4" in caplog.text


def test_cacheable_adds_the_dump_keyword_and_nothing_else(tmp_path):
    calls = []

    @cacheable
    def stage(batch: TensorDict, scale: int = 1) -> StageResult:
        calls.append(scale)
        return StageResult(batch, {"m": float(scale)})

    assert list(inspect.signature(stage).parameters) == ["batch", "scale", "dump"]
    plain = stage(sample_batch(), scale=2)
    assert type(plain) is StageResult and plain.metrics == {"m": 2.0}
    cache = StepCache(str(tmp_path / "root"))
    dumped = stage(sample_batch(), 3, dump=StepDump(cache, 1, {}, timeout_s=30))
    assert isinstance(dumped, StageRecord) and dumped.manifest["metrics"] == {"m": 3.0}
    assert calls == [2, 3] and not cache.status(1).valid  # payload only: Prefect commits the marker
