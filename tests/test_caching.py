"""The pieces of stage caching that need no server: records and fingerprints."""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict

from ppoflow.storage.batch import with_non_tensor_columns
from ppoflow.storage.rollout_cache import CacheWriteError, StepCache
from ppoflow.tasks.caching import ManifestSerializer, StageRecord, StepDump, dump_stage, fingerprint


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
    assert blob == StepCache.encode_manifest(manifest)  # the marker bytes, no tensors
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


def test_dump_stage_reports_a_failed_write_as_a_metric(tmp_path, monkeypatch, caplog):
    cache = StepCache(str(tmp_path / "root"), stage="reward", write_retries=1, retry_backoff_s=0)

    def refuse(*args, **kwargs):
        raise CacheWriteError("somewhere", "refused")

    monkeypatch.setattr(cache, "write_payload", refuse)
    caplog.set_level(logging.WARNING)
    record = dump_stage(StepDump(cache, 4, {}), sample_batch(), {"reward/x/mean": 0.5})
    assert record.manifest is None and record.metrics == {"reward/x/mean": 0.5, "skip/reward/dump_failed": 1.0}
    assert "could not cache reward of step 4" in caplog.text
    assert dump_stage(None, sample_batch(), {}).manifest is None
