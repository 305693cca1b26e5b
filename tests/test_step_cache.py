"""Tests of the step cache's store (storage/step_cache/) and its fsspec helpers (storage/fs.py).

They start from verl's skip tests (layout, valid-step scan, cache/repeat resolution) and add what
verl leaves untested: commit markers, corruption, write failures, stage isolation, the V1 uid
remapping and S3 listings seen from another process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from tensordict import TensorDict

from ppoflow.storage import fs as storage_fs
from ppoflow.storage.batch import NON_TENSOR_FIELDS, non_tensor_column, with_non_tensor_columns
from ppoflow.storage.step_cache import CacheCorrupt, CacheEntry, CacheWriteError, StepCache, config_dir, scan
from ppoflow.storage.step_cache.manifest import STEP_MARKER, StepStatus, decode_manifest
from ppoflow.storage.step_cache.store import encode_manifest

REPO_ROOT = Path(__file__).resolve().parents[1]
BUCKET = "ppoflow-test"  # created by the s3_server fixture
CONFIG = dict(experiment_name="ut_exp", project_name="ut_proj", gbs=4, n=2, max_prompt_length=8, max_response_length=16)
CACHE_LOGGER = "ppoflow.storage.step_cache"


def make_batch(uids: list[str], seed: int = 0, prompt_length: int = 3, response_length: int = 4) -> TensorDict:
    """A small step batch with every rollout field; ``prompts[:, 0]`` holds the row number."""
    rows = len(uids)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 1000, (rows, prompt_length), generator=generator)
    prompts[:, 0] = torch.arange(rows)
    first_seen = list(dict.fromkeys(uids))
    batch = TensorDict(
        {
            "prompts": prompts,
            "prompt_mask": torch.rand(rows, prompt_length, generator=generator) > 0.2,
            "responses": torch.randint(0, 1000, (rows, response_length), generator=generator),
            "response_mask": torch.rand(rows, response_length, generator=generator) > 0.2,
            "rollout_log_probs": -torch.rand(rows, response_length, generator=generator),
            "weight_version": torch.full((rows,), 3, dtype=torch.int64),
            "group_index": torch.tensor([first_seen.index(uid) for uid in uids], dtype=torch.int64),
        },
        batch_size=[rows],
    )
    return with_non_tensor_columns(
        batch,
        {
            "uid": uids,
            "data_source": ["gsm8k" if row % 2 else "math" for row in range(rows)],
            "ground_truth": [
                {"answer": str(row), "steps": [row, seed]} if row % 2 else str(row) for row in range(rows)
            ],
        },
    )


def assert_same_batch(actual: TensorDict, expected: TensorDict) -> None:
    assert set(actual.keys()) == set(expected.keys())
    assert actual.batch_size == expected.batch_size
    for name in expected.keys():
        if name in NON_TENSOR_FIELDS:
            assert non_tensor_column(actual, name) == non_tensor_column(expected, name), name
        else:
            assert actual[name].dtype == expected[name].dtype, name
            assert torch.equal(actual[name], expected[name]), name


@pytest.fixture
def root(tmp_path: Path) -> str:
    return config_dir(str(tmp_path / "dump"), **CONFIG)


@pytest.fixture
def cache(root: str) -> StepCache:
    return StepCache(root, write_retries=2, retry_backoff_s=0)


def write_steps(cache: StepCache, steps: list[int]) -> None:
    for step in steps:
        cache.write(step, make_batch(["a", "a", "b", "b"], seed=step))


def warnings_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record.getMessage() for record in caplog.records if record.name.startswith(CACHE_LOGGER))


# -- layout --------------------------------------------------------------------------------------


def test_layout_matches_verl(tmp_path: Path, root: str, cache: StepCache):
    assert root == str(tmp_path.resolve() / "dump" / "ut_exp_ut_proj" / "GBS4_N2_in8_out16")
    cache.write(3, make_batch(["a", "a", "b", "b"]))
    step_dir = Path(root) / "3"
    assert cache.step_url(3) == str(step_dir)
    assert cache.payload_url(3) == str(step_dir / "rollout.safetensors")
    assert cache.marker_url(3) == str(step_dir / "meta.json")
    assert sorted(os.listdir(step_dir)) == ["meta.json", "rollout.safetensors"]  # no temp files left
    reward = StepCache(root, stage="old_log_prob")
    assert reward.payload_url(3) == str(step_dir / "old_log_prob.safetensors")
    assert reward.marker_url(3) == str(step_dir / "old_log_prob.meta.json")


def test_config_dir_expands_home_resolves_relative_and_keeps_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    suffix = "ut_exp_ut_proj/GBS4_N2_in8_out16"
    assert (
        config_dir("~/.ppoflow/rollout_dump", **CONFIG) == f"{tmp_path.resolve()}/home/.ppoflow/rollout_dump/{suffix}"
    )
    assert config_dir("relative/dump", **CONFIG) == f"{tmp_path.resolve()}/relative/dump/{suffix}"
    assert config_dir(f"file://{tmp_path}/dump", **CONFIG) == f"{tmp_path.resolve()}/dump/{suffix}"
    assert config_dir("s3://bucket/dump/", **CONFIG) == f"s3://bucket/dump/{suffix}"
    with pytest.raises(ValueError, match="'/'"):
        config_dir("s3://bucket", **{**CONFIG, "experiment_name": "a/b"})


def test_step_url_rejects_non_integers(cache: StepCache):
    with pytest.raises(TypeError):
        cache.step_url(True)
    with pytest.raises(TypeError):
        cache.step_url("3")  # type: ignore[arg-type]


# -- round trip and manifest --------------------------------------------------------------------


def test_round_trip_and_manifest(cache: StepCache):
    batch = make_batch(["a", "a", "b", "b"])
    manifest = cache.write(7, batch, meta={"weight_version": 3, "sampling": {"temperature": 1.0}})
    payload = Path(cache.payload_url(7)).read_bytes()
    assert manifest["format_version"] == STEP_MARKER.version
    assert manifest["stage"] == "rollout"
    assert manifest["global_steps"] == 7
    assert manifest["num_trajectories"] == 4
    assert manifest["files"] == {
        "rollout.safetensors": {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    }
    assert manifest["sampling"] == {"temperature": 1.0}
    marker = Path(cache.marker_url(7)).read_bytes()
    assert marker == encode_manifest(manifest)
    assert list(json.loads(marker)) == sorted(manifest)
    assert cache.status(7) == StepStatus(step=7, valid=True, reason="", nbytes=len(payload))

    loaded, loaded_manifest = cache.load(7)
    assert_same_batch(loaded, batch)
    assert loaded_manifest == manifest


def test_meta_must_not_clash_and_must_be_json(cache: StepCache):
    with pytest.raises(ValueError, match="global_steps"):
        cache.write(1, make_batch(["a"]), meta={"global_steps": 9})
    with pytest.raises(TypeError):
        cache.write(1, make_batch(["a"]), meta={"tensor": torch.zeros(1)})
    assert not Path(cache.step_url(1)).exists()


def test_write_marker_refuses_a_manifest_of_another_step(cache: StepCache):
    manifest = cache.write_payload(1, make_batch(["a"]))
    with pytest.raises(ValueError, match="global_steps"):
        cache.write_marker(2, manifest)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x00garbage", "Expecting value"),
        (b"[1, 2]", "not an object"),
        (b'{"format_version": 2}', "field 'stage'"),
        ("bool", "expected int"),
        ("version", "format_version 1"),
        ("checksum", "expected {bytes: int >= 0, sha256: hex}"),
        ("two payloads", "exactly one payload"),
        ("unsafe name", "unsafe file name"),
    ],
)
def test_decode_manifest_rejects_bad_markers(cache: StepCache, data, message):
    manifest = cache.write(1, make_batch(["a"]))
    entry = manifest["files"]["rollout.safetensors"]
    changes = {
        "bool": {"num_trajectories": True},
        "version": {"format_version": 1},
        "checksum": {"files": {"rollout.safetensors": {**entry, "sha256": "md5:00"}}},
        "two payloads": {"files": {"rollout.safetensors": entry, "x.safetensors": entry}},
        "unsafe name": {"files": {"../rollout.safetensors": entry}},
    }
    if isinstance(data, str):
        data = json.dumps({**manifest, **changes[data]}).encode()
    with pytest.raises(ValueError, match=re.escape(message)):
        decode_manifest(data)


# -- resolution (verl's cases) --------------------------------------------------------------------


def test_resolve_cache_and_repeat_like_verl(cache: StepCache):
    assert cache.resolve(100, "repeat") is None  # empty root
    assert cache.resolve(100, "cache") is None
    write_steps(cache, [5, 20])
    assert cache.valid_steps() == [5, 20]
    assert cache.resolve(5, "repeat") == 5  # exact
    assert cache.resolve(12, "repeat") == 5  # largest smaller
    assert cache.resolve(3, "repeat") == 5  # else smallest larger
    assert cache.resolve(25, "repeat") == 20
    assert cache.resolve(5, "cache") == 5
    assert cache.resolve(12, "cache") is None
    with pytest.raises(ValueError, match="random"):
        cache.resolve(5, "random")


def test_only_canonical_integer_dirs_are_steps(cache: StepCache, root: str):
    write_steps(cache, [1, 10, 0, -3])
    root_path = Path(root)
    (root_path / "not_int").mkdir()
    (root_path / "2").mkdir()  # empty: no entry at all
    for name in ("007", "+7", " 7", "-0"):  # int() accepts these; they are not what step_url writes
        (root_path / name).mkdir()
        for file in ("meta.json", "rollout.safetensors"):
            (root_path / name / file).write_bytes((root_path / "1" / file).read_bytes())
    (root_path / "4" / "0").mkdir(parents=True)  # verl V1 layout: {step}/{inner}/ files are not ours
    (root_path / "4" / "0" / "meta.json").write_text('{"global_steps": 4}')
    assert cache.valid_steps() == [-3, 0, 1, 10]
    assert [status.step for status in cache.steps()] == [-3, 0, 1, 10]


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


# -- remove and stages ----------------------------------------------------------------------------


def test_remove_marker_first_and_only_this_stage(cache: StepCache, root: str, monkeypatch: pytest.MonkeyPatch):
    write_steps(cache, [2])
    reward = StepCache(root, stage="reward")
    reward.write(2, make_batch(["a", "a", "b", "b"], seed=5))
    removed: list[str] = []
    original_rm_file = LocalFileSystem.rm_file

    def recording_rm_file(self, path):
        removed.append(path)
        return original_rm_file(self, path)

    monkeypatch.setattr(LocalFileSystem, "rm_file", recording_rm_file)
    cache.remove(2)
    assert removed == [cache.marker_url(2), cache.payload_url(2)]
    assert not cache.status(2).valid
    assert sorted(os.listdir(cache.step_url(2))) == ["reward.meta.json", "reward.safetensors"]
    assert reward.valid_steps() == [2]
    cache.remove(2)  # removing nothing is fine


def test_stages_are_isolated(cache: StepCache, root: str):
    rollout_batch = make_batch(["a", "a", "b", "b"])
    reward_batch = make_batch(["a", "a", "b", "b"], seed=1)
    reward_batch.set("token_level_scores", torch.ones(4, 4))
    cache.write(3, rollout_batch)
    cache.write(5, rollout_batch)
    reward = StepCache(root, stage="reward")
    reward.write(3, reward_batch)
    assert sorted(os.listdir(cache.step_url(3))) == [
        "meta.json",
        "reward.meta.json",
        "reward.safetensors",
        "rollout.safetensors",
    ]
    assert_same_batch(cache.load(3)[0], rollout_batch)
    assert_same_batch(reward.load(3)[0], reward_batch)
    assert [status.step for status in reward.steps()] == [3]  # step 5 holds no reward entry
    Path(reward.payload_url(3)).write_bytes(b"broken")
    assert not reward.status(3).valid
    assert cache.valid_steps() == [3, 5]


def test_scan_lists_every_stage_entry(tmp_path: Path):
    dump_dir = str(tmp_path / "dump")
    first = StepCache(config_dir(dump_dir, **CONFIG))
    second = StepCache(config_dir(dump_dir, **{**CONFIG, "n": 8}), stage="old_log_prob")
    first.write(1, make_batch(["a"]))
    first.write_payload(2, make_batch(["a"]))
    StepCache(first.root, stage="reward").write(1, make_batch(["a"]))
    second.write(10, make_batch(["a", "b"]))
    (Path(first.step_url(1)) / "notes.txt").write_text("ignored")
    entries = scan(dump_dir)
    summary = [(entry.config, entry.step, entry.stage, entry.valid, entry.reason) for entry in entries]
    assert summary == [
        ("GBS4_N2_in8_out16", 1, "reward", True, ""),
        ("GBS4_N2_in8_out16", 1, "rollout", True, ""),
        ("GBS4_N2_in8_out16", 2, "rollout", False, "missing meta.json"),
        ("GBS4_N8_in8_out16", 10, "old_log_prob", True, ""),
    ]
    assert {entry.project for entry in entries} == {"ut_exp_ut_proj"}
    assert entries[1] == CacheEntry(
        "ut_exp_ut_proj", "GBS4_N2_in8_out16", "rollout", 1, True, "", first.status(1).nbytes
    )
    assert scan(str(tmp_path / "nothing")) == []
