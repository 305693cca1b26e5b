"""The pieces of stage caching that need no server: records, fingerprints, the per-sample cache."""

from __future__ import annotations

import logging

import pytest
import torch
from tensordict import TensorDict

from configs import load_config
from storage.batch import with_non_tensor_columns
from storage.rollout_cache import CacheWriteError, StepCache
from tasks.caching import ManifestSerializer, SampleCache, StageRecord, StepDump, dump_stage, fingerprint


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


@pytest.fixture
def sample_cache(tiny_overrides, tmp_path):
    def make(action: str) -> SampleCache:
        cfg = load_config("grpo_tiny", tiny_overrides + [
            "skip.async_rollout.enable=true", f"skip.async_rollout.dump_dir={tmp_path}/dump",
            "skip.async_rollout.steps=[1,2,5]", f"skip.async_rollout.action={action}"])
        return SampleCache(cfg.skip["async_rollout"], cfg)
    return make


def test_sample_cache_keys_entries_by_feed_index(sample_cache):
    cache = sample_cache("cache")
    assert cache.lookup("uid_sample_0_1") is None
    assert cache.store("uid_sample_0_1", sample_batch("old", fill=7))
    assert not cache.store("sample_3_4", sample_batch())  # index 4 is not covered
    replayed = cache.lookup("sample_9_1")  # another epoch, same feed index
    assert replayed["responses"].eq(7).all()
    assert list(replayed.get("uid").tolist()) == ["sample_9_1", "sample_9_1"]
    assert cache.lookup("sample_0_2") is None  # cache: only its own entry
    assert sample_cache("repeat").lookup("sample_0_5")["responses"].eq(7).all()  # repeat: the nearest below


@pytest.mark.parametrize("bad", ["bad_id", "sample_1", "uid_uid_sample_0_1", "sample_0_x"])
def test_sample_cache_rejects_malformed_ids_even_outside_its_steps(sample_cache, bad):
    with pytest.raises(ValueError, match="Invalid async rollout sample_id"):
        sample_cache("cache").lookup(bad)
