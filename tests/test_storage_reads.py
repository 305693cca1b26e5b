"""Reading payloads back: sha256 computed while reading, and safetensors decoded without copies."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as reference_load
from safetensors.torch import save
from tensordict import TensorDict

from ppoflow.storage.batch import decode_batch, encode_batch, read_safetensors, with_non_tensor_columns
from ppoflow.storage.fs import read_with_sha256


@pytest.mark.parametrize("size", [0, 5, (8 << 20) * 2 + 3])  # empty, one short chunk, three chunks
def test_read_with_sha256_returns_the_bytes_and_their_digest(tmp_path: Path, size: int):
    data = os.urandom(size)
    (tmp_path / "blob").write_bytes(data)
    view, digest = read_with_sha256(LocalFileSystem(), str(tmp_path / "blob"))
    assert bytes(view) == data and digest == hashlib.sha256(data).hexdigest()
    assert not view.readonly


def test_read_safetensors_agrees_with_the_reference_loader():
    tensors = {
        "ids": torch.arange(12).reshape(3, 4),
        "mask": torch.tensor([True, False, True]),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "odd": torch.arange(7, dtype=torch.uint8),
        "f64": torch.randn(2, 3, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }
    payload = save(tensors, metadata={"note": "kept"})
    decoded, metadata = read_safetensors(payload)
    expected = reference_load(payload)
    assert decoded.keys() == expected.keys() and metadata == {"note": "kept"}
    for name, tensor in expected.items():
        assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor), name


def test_a_loaded_batch_views_the_read_buffer(tmp_path: Path):
    batch = TensorDict(
        {"responses": torch.arange(64).reshape(8, 8), "rollout_log_probs": torch.randn(8, 8)}, batch_size=[8]
    )
    with_non_tensor_columns(batch, {"uid": [str(i // 2) for i in range(8)]})
    (tmp_path / "step").write_bytes(encode_batch(batch))
    view, _ = read_with_sha256(LocalFileSystem(), str(tmp_path / "step"))
    loaded = decode_batch(view)
    start = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    for name in ("responses", "rollout_log_probs"):
        assert torch.equal(loaded[name], batch[name])
        assert start <= loaded[name].data_ptr() < start + len(view), f"{name} was copied"
    loaded["responses"][0, 0] = -1  # writable memory: no aliasing of immutable bytes
    assert loaded["responses"][0, 0] == -1


def handmade(header: dict, data: bytes) -> bytes:
    """A safetensors buffer written by hand, to reach layouts and damage the real writer never produces."""
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


def test_a_misaligned_tensor_is_read_correctly():
    value = torch.tensor([7, -3], dtype=torch.int64)
    payload = handmade(
        {
            "flag": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "ids": {"dtype": "I64", "shape": [2], "data_offsets": [1, 17]},
        },
        b"\x01" + value.numpy().tobytes(),
    )
    decoded, _ = read_safetensors(payload)
    assert torch.equal(decoded["ids"], value) and decoded["flag"].tolist() == [1]


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\x10\x00", "truncated safetensors header"),
        ((100).to_bytes(8, "little") + b"{}", "truncated safetensors header"),
        (
            handmade({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)),
            "tensor 'x': unsupported dtype 'C64'",
        ),
        (
            handmade({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
            "tensor 'x': bytes 0..16 do not hold torch.float32 [4] within the 8-byte data section",
        ),
        (
            handmade({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, bytes(16)),
            "tensor 'x': bytes 0..16 do not hold torch.float32 [3]",
        ),
        (
            handmade({"x": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, bytes(16)),
            "tensor 'x': bytes -4..0",
        ),
    ],
)
def test_a_damaged_header_raises_naming_the_tensor(payload: bytes, message: str):
    with pytest.raises(ValueError, match=re.escape(message)):
        read_safetensors(payload)
