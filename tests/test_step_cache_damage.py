"""The step cache's store (storage/step_cache/) and its fsspec helpers (storage/fs.py) when things go wrong:
damaged entries read invalid and are skipped with a warning, writes that fail are retried or leave no valid
entry, and the cache and its errors survive pickling."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from ppoflow.storage import fs as storage_fs
from ppoflow.storage.step_cache import CacheCorrupt, CacheWriteError, StepCache
from ppoflow.storage.step_cache.store import encode_manifest
from tests.step_cache_helpers import CACHE_LOGGER, make_batch, warnings_text, write_steps

# -- damaged entries ------------------------------------------------------------------------------


def assert_skipped(cache: StepCache, step: int, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    """The entry reads invalid, both actions skip it with a warning naming its path, load refuses it."""
    status = cache.status(step)
    assert not status.valid
    assert reason in status.reason
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert cache.resolve(step, "cache") is None
        assert cache.resolve(step, "repeat") == 1  # falls back to the valid step 1
    assert f"{cache.step_url(step)}: {status.reason}" in warnings_text(caplog)
    assert step not in cache.valid_steps()
    with pytest.raises(CacheCorrupt):
        cache.load(step)


def test_payload_without_marker_reads_invalid(cache: StepCache, caplog: pytest.LogCaptureFixture):
    write_steps(cache, [1])
    cache.write_payload(3, make_batch(["a", "a"]))  # a crash before the marker
    assert_skipped(cache, 3, "missing meta.json", caplog)


def test_truncated_payload_reads_invalid(cache: StepCache, caplog: pytest.LogCaptureFixture):
    write_steps(cache, [1, 3])
    payload = Path(cache.payload_url(3))
    size = payload.stat().st_size
    payload.write_bytes(payload.read_bytes()[:120])
    assert_skipped(cache, 3, f"rollout.safetensors has 120 bytes, {size} recorded", caplog)


def test_missing_payload_reads_invalid(cache: StepCache, caplog: pytest.LogCaptureFixture):
    write_steps(cache, [1, 3])
    Path(cache.payload_url(3)).unlink()
    assert_skipped(cache, 3, "missing rollout.safetensors", caplog)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other_step", "other_stage"])
def test_bad_marker_reads_invalid(cache: StepCache, caplog: pytest.LogCaptureFixture, damage: str):
    write_steps(cache, [1, 3])
    marker = Path(cache.marker_url(3))
    manifest = json.loads(marker.read_bytes())
    replacements = {
        "garbage": b"\xff\xfe not json",
        "truncated": marker.read_bytes()[:40],
        "empty": b"",
        "other_step": encode_manifest({**manifest, "global_steps": 4}),
        "other_stage": encode_manifest({**manifest, "stage": "reward"}),
    }
    marker.write_bytes(replacements[damage])
    reason = {"other_step": "global_steps 4", "other_stage": "stage 'reward'"}.get(damage, "unreadable meta.json")
    assert_skipped(cache, 3, reason, caplog)


def test_checksum_mismatch_with_same_size_fails_to_load(cache: StepCache):
    write_steps(cache, [3])
    payload = Path(cache.payload_url(3))
    data = bytearray(payload.read_bytes())
    data[-8:] = bytes(byte ^ 0xFF for byte in data[-8:])  # flip tensor bytes, keep the size
    payload.write_bytes(bytes(data))
    assert cache.status(3).valid  # the cheap check cannot see it...
    with pytest.raises(CacheCorrupt, match="checksum") as raised:
        cache.load(3)  # ...the load does
    assert raised.value.path == cache.payload_url(3)


def test_valid_steps_warns_about_each_invalid_dir(cache: StepCache, caplog: pytest.LogCaptureFixture):
    write_steps(cache, [1, 2, 3])
    Path(cache.marker_url(2)).write_bytes(b"{")
    Path(cache.payload_url(3)).write_bytes(b"short")
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert cache.valid_steps() == [1]
    text = warnings_text(caplog)
    assert cache.step_url(2) in text and cache.step_url(3) in text


# -- write failures -------------------------------------------------------------------------------


def refuse_local_writes(monkeypatch: pytest.MonkeyPatch, should_fail) -> list[str]:
    """Make LocalFileSystem.open raise OSError for writes to paths where ``should_fail(path)``."""
    attempts: list[str] = []
    original_open = LocalFileSystem.open

    def open_or_fail(self, path, mode="rb", *args, **kwargs):
        if "w" in mode and should_fail(path):
            attempts.append(path)
            raise OSError(28, "No space left on device")
        return original_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "open", open_or_fail)
    return attempts


def test_failing_payload_write_is_retried_then_raises(cache: StepCache, monkeypatch: pytest.MonkeyPatch):
    attempts = refuse_local_writes(monkeypatch, lambda path: True)
    with pytest.raises(CacheWriteError, match="3 attempts") as raised:
        cache.write(4, make_batch(["a", "a"]))
    assert raised.value.path == cache.payload_url(4)
    assert len(attempts) == cache.write_retries + 1
    assert not cache.status(4).valid
    assert cache.valid_steps() == []
    assert os.listdir(cache.step_url(4)) == []  # no temp file left behind


def test_transient_write_failure_recovers(cache: StepCache, monkeypatch: pytest.MonkeyPatch):
    attempts = refuse_local_writes(monkeypatch, lambda path: len(attempts) < 2)
    cache.write(4, make_batch(["a", "a"]))
    assert len(attempts) == 2
    assert cache.valid_steps() == [4]


def test_failing_marker_write_over_an_old_entry_leaves_it_invalid(cache: StepCache, monkeypatch: pytest.MonkeyPatch):
    write_steps(cache, [4])
    refuse_local_writes(monkeypatch, lambda path: "meta.json" in path)
    with pytest.raises(CacheWriteError) as raised:
        cache.write(4, make_batch(["x", "y"], seed=9))
    assert raised.value.path == cache.marker_url(4)
    assert cache.status(4).reason == "missing meta.json"  # the old marker went before the new payload
    with pytest.raises(CacheCorrupt):
        cache.load(4)


def test_atomic_write_keeps_the_old_file_when_a_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fs, path = storage_fs.open_fs(str(tmp_path / "dir" / "file.bin"))
    storage_fs.atomic_write(fs, path, b"old")

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        storage_fs.atomic_write(fs, path, b"new contents")
    assert Path(path).read_bytes() == b"old"
    assert os.listdir(tmp_path / "dir") == ["file.bin"]


def test_step_cache_survives_pickling(cache: StepCache):
    write_steps(cache, [1])
    copy = pickle.loads(pickle.dumps(cache))  # as when shipped to a Ray worker
    assert copy.valid_steps() == [1]


def test_cache_errors_survive_pickling():
    for error in (CacheCorrupt("s3://b/k", "bad"), CacheWriteError("s3://b/k", "full")):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), copy.path, copy.reason, str(copy)) == (type(error), "s3://b/k", error.reason, str(error))
