"""The V1 replay buffer's save and load (storage/replay_buffer.py, storage/replay_buffer_files.py): a round
trip on local disk and on S3, and the refusal of changed payloads and missing or damaged markers."""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from ppoflow.storage.batch import non_tensor_column
from ppoflow.storage.fs import StorageError
from ppoflow.storage.replay_buffer import ReplayBuffer
from ppoflow.storage.replay_buffer_files import BUFFER_MARKER
from tests.replay_buffer_helpers import PAD, make_group, no_poll


def assert_same_batch(actual: TensorDict, expected: TensorDict) -> None:
    assert list(actual.batch_size) == list(expected.batch_size)
    assert sorted(actual.keys()) == sorted(expected.keys())
    for name in expected.keys():
        if isinstance(expected.get(name), NonTensorStack):
            assert non_tensor_column(actual, name) == non_tensor_column(expected, name), name
        else:
            assert torch.equal(actual[name], expected[name]), name


# -- save and load ------------------------------------------------------------------------------------------


def mixed_buffer() -> ReplayBuffer:
    """Finished train groups of two prompt widths, a finished val group, and pending, running and failed prompts."""
    buffer = ReplayBuffer(pad_token_id=PAD, max_off_policy_threshold=4)
    buffer.add_prompts(["narrow", "wide", "pending", "running", "failed"], 2)
    buffer.add_prompts(["later"], 3)
    buffer.add_prompts(["v"], 3, partition="val")
    buffer.finish("wide", make_group(2, n=3, width=5, oldest=[1, 1, 2], newest=[2, 2, 2]))
    buffer.finish("narrow", make_group(1, width=2))
    buffer.finish("later", make_group(4))
    buffer.finish("v", make_group(5))
    buffer.mark_running("running")
    buffer.fail("failed", "timeout")
    return buffer


def assert_restored(loaded: ReplayBuffer, saved: ReplayBuffer) -> None:
    """``loaded`` holds what ``saved`` held, with its running prompt back to pending."""
    expected = saved.state_dict()
    actual = loaded.state_dict()
    assert actual["prompts"] == [
        {**tags, "status": "pending"} if tags["status"] == "running" else tags for tags in expected["prompts"]
    ]
    assert list(actual["groups"]) == list(expected["groups"]) == ["narrow", "wide", "later", "v"]
    for uid, group in expected["groups"].items():
        assert_same_batch(actual["groups"][uid], group)
    assert loaded.in_flight() == {"pending": 2, "running": 2}
    assert loaded.trajectory_keys("wide") == ["wide_0_0", "wide_1_0", "wide_2_0"]
    loaded_batch, loaded_metrics = loaded.sample(4, 3, poll=no_poll)
    saved_batch, saved_metrics = saved.sample(4, 3, poll=no_poll)
    assert_same_batch(loaded_batch, saved_batch)
    assert loaded_metrics == saved_metrics


def test_save_and_load_round_trip_on_local_disk(tmp_path):
    buffer = mixed_buffer()
    url = str(tmp_path / "buffer")
    buffer.save(url)
    assert sorted(path.name for path in (tmp_path / "buffer" / "groups").iterdir()) == [
        "0.safetensors",
        "1.safetensors",
        "2.safetensors",
        "3.safetensors",
    ]
    assert_restored(ReplayBuffer.load(url, pad_token_id=PAD, max_off_policy_threshold=4), buffer)
    buffer.save(url)  # after the sample only the val group is left; the older payloads are gone
    assert [path.name for path in (tmp_path / "buffer" / "groups").iterdir()] == ["0.safetensors"]
    assert ReplayBuffer.load(url, pad_token_id=PAD).finished_count("val") == 1


def test_load_refuses_a_changed_payload_and_a_missing_or_damaged_marker(tmp_path):
    url = str(tmp_path / "buffer")
    mixed_buffer().save(url)
    payload = tmp_path / "buffer" / "groups" / "1.safetensors"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 1
    payload.write_bytes(bytes(data))
    with pytest.raises(StorageError, match=r"groups/1\.safetensors: checksum"):
        ReplayBuffer.load(url, pad_token_id=PAD)
    unfinished_group = BUFFER_MARKER.encode(
        {},
        groups={},
        prompts=[{"uid": "a", "status": "finished", "dispatch_step": 1, "partition": "train", "num_trajectories": 2}],
    )
    (tmp_path / "buffer" / "buffer.json").write_bytes(unfinished_group)
    with pytest.raises(StorageError, match=r"buffer\.json: inconsistent buffer\.json: KeyError\('a'\)"):
        ReplayBuffer.load(url, pad_token_id=PAD)
    (tmp_path / "buffer" / "buffer.json").write_text('{"format_version": 1, "files": {}}')
    with pytest.raises(StorageError, match=r"buffer\.json: unreadable buffer\.json"):
        ReplayBuffer.load(url, pad_token_id=PAD)
    (tmp_path / "buffer" / "buffer.json").unlink()
    with pytest.raises(StorageError, match=r"buffer\.json: missing file"):
        ReplayBuffer.load(url, pad_token_id=PAD)


def test_save_and_load_on_s3(s3_server):
    _, storage_options = s3_server
    options = {**storage_options, "use_listings_cache": False}
    url = f"s3://ppoflow-test/{uuid.uuid4().hex}/buffer"
    buffer = mixed_buffer()
    buffer.save(url, options)
    fs = fsspec.filesystem("s3", **options)
    assert fs.exists(f"{url}/buffer.json") and len(fs.find(f"{url}/groups")) == 4
    assert_restored(ReplayBuffer.load(url, options, pad_token_id=PAD, max_off_policy_threshold=4), buffer)
