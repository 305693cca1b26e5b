"""A safetensors file written one tensor at a time, so that exporting a model holds no second copy of it.

transformers' ``save_pretrained`` takes the whole state dict at once. A LoRA export's merged weights are a new
tensor for every adapted layer, so they existed beside the base all together, and that set a LoRA run's peak
memory at its very end. Here the header comes first, from the names, dtypes and shapes of a layout (tensors that
may alias the model's own), and each tensor's bytes follow as an iterator yields it, straight from its memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping

import torch

from ppoflow.storage.batch import SAFETENSORS_DTYPES

_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def write_safetensors(
    path: str,
    layout: Mapping[str, torch.Tensor],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to the local file ``path`` in safetensors format. ``layout`` names every tensor to be
    written, in order, with its dtype and shape (its values are only read for those); ``tensors`` yields them
    in that order, each matching its entry. ValueError when one is missing, extra, out of order or unlike its
    entry (the file is then incomplete: callers write into a staging directory)."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, tensor in layout.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    expected = iter(layout.items())
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, tensor in tensors:
            want_name, want = next(expected, (None, None))
            if want is None or name != want_name or (tensor.dtype, tensor.shape) != (want.dtype, want.shape):
                expected_entry = "none left" if want is None else f"{want_name!r} {want.dtype} {list(want.shape)}"
                raise ValueError(f"{path}: {name!r} {tensor.dtype} {list(tensor.shape)} is not the layout's next "
                                 f"entry ({expected_entry})")  # fmt: skip
            data = tensor.detach().cpu().contiguous().reshape(-1)
            file.write(data.view(torch.uint8).numpy().data if data.numel() else b"")
        missing = [name for name, _ in expected]
        if missing:
            raise ValueError(f"{path}: no tensor came for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
