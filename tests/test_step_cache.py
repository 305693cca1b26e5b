"""The step cache's store (storage/step_cache/): verl's skip cases (layout, valid-step scan, cache/repeat
resolution), its manifest, removal, stage isolation and the dump-wide scan. Damaged entries and write
failures: tests/test_step_cache_damage.py; S3: tests/test_step_cache_s3.py; the uid remap:
tests/test_step_cache_remap.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from ppoflow.storage.step_cache import CacheEntry, StepCache, config_dir, scan
from ppoflow.storage.step_cache.manifest import STEP_MARKER, StepStatus, decode_manifest
from ppoflow.storage.step_cache.store import encode_manifest
from tests.step_cache_helpers import CONFIG, assert_same_batch, make_batch, write_steps

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
