"""The step batch: one TensorDict per training step, its schema, and its safe byte encoding.

Every stage reads and extends the same batch, and the rollout cache stores it, so its fields are fixed here:
the rollout writes ``prompts``, ``prompt_mask``, ``responses``, ``response_mask``, ``rollout_log_probs``,
``weight_version``, ``group_index`` (``turn_ids``, ``num_turns``, ``tool_calls`` with the rollout service) and the
per-prompt ``uid``, ``data_source``, ``ground_truth``, ``extra_info``; later stages add the rest. The encoding is
safetensors, the non-tensor columns and batch size as JSON in its header: decoding never unpickles anything. Every
stage returns a :class:`StageResult`. The field table (dtypes, shapes, meanings):
docs/architecture.md#the-step-batch-and-its-metrics.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from safetensors.torch import save as safetensors_save
from tensordict import NonTensorData, NonTensorStack, TensorDict

NON_TENSOR_FIELDS = ("uid", "data_source", "ground_truth", "extra_info")
AGENT_FIELDS = ("agent_name", "tools_kwargs", "sample_id", "raw_prompt")
"""Per-prompt columns only the rollout reads (a dataset's ``agent_name``, ``extra_info.tools_kwargs`` and its
prompt as written, present when the dataset has them; a train prompt's place in the feed order, which keys the rollout
service's sample cache); they do not stay in the step batch."""
RESPONSE_FIELDS = (
    "responses",
    "response_mask",
    "rollout_log_probs",
    "turn_ids",
    "token_level_scores",
    "token_level_rewards",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "advantages",
    "returns",
    "rollout_is_weights",
)
"""Fields aligned with the response tokens ([N, R]); :func:`trim_response_padding` slices them together."""


@dataclass
class StageResult:
    """What every stage returns: the fields it adds to the step batch (None when it adds none, as the
    updates and the weight sync) and its metrics (verl's names)."""

    fields: TensorDict | None
    metrics: dict[str, float] = field(default_factory=dict)


_NON_TENSOR_KEY = "ppoflow.non_tensor"
_BATCH_SIZE_KEY = "ppoflow.batch_size"
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


def non_tensor_column(batch: TensorDict, name: str) -> list:
    """Return a per-sample non-tensor field (``uid``, ``data_source``, ...) as a plain list."""
    return list(batch.get(name).tolist())


def with_non_tensor_columns(batch: TensorDict, columns: dict[str, list]) -> TensorDict:
    """Attach per-sample non-tensor columns to ``batch`` (in place) and return it."""
    for name, values in columns.items():
        if len(values) != batch.batch_size[0]:
            raise ValueError(f"column {name!r} has {len(values)} values for a batch of {batch.batch_size[0]}")
        # Wrap list/dict/... values so that they stay opaque instead of being stacked; NonTensorStack
        # wraps scalars itself (on a fast path: a scalar wrapped here would take the general one).
        batch.set(
            name, NonTensorStack(*[value if type(value) in _SCALARS else NonTensorData(data=value) for value in values])
        )
    return batch


def concatenate(*chunks: TensorDict, pad_token_id: int) -> TensorDict:
    """Consecutive chunks of a batch as one batch: prompts left-padded to the widest chunk's, per-row
    non-tensor columns joined in order."""
    names = [name for name in chunks[0].keys() if isinstance(chunks[0].get(name), NonTensorStack)]
    width = max(chunk["prompts"].shape[1] for chunk in chunks)
    tensors = []
    for chunk in chunks:
        chunk, missing = chunk.exclude(*names), width - chunk["prompts"].shape[1]
        if missing:
            chunk["prompts"] = torch.nn.functional.pad(chunk["prompts"], (missing, 0), value=pad_token_id)
            chunk["prompt_mask"] = torch.nn.functional.pad(chunk["prompt_mask"], (missing, 0), value=False)
        tensors.append(chunk)
    columns = {name: [row for chunk in chunks for row in non_tensor_column(chunk, name)] for name in names}
    return with_non_tensor_columns(torch.cat(tensors, dim=0), columns)


def response_extent(batch: TensorDict) -> torch.Tensor:
    """Per trajectory, how many response positions it occupies ([N]): up to its last model token, or its
    last tool-answer token in a multi-turn batch (whose ``response_mask`` has holes where the tools spoke)."""
    return _end_of_last_true(batch["turn_ids"] != 0 if "turn_ids" in batch.keys() else batch["response_mask"])


def last_model_token(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last ``response_mask`` position ([N]; 0 for an empty row): where the outcome
    reward goes, also in a multi-turn trajectory whose mask has holes."""
    return (_end_of_last_true(response_mask) - 1).clamp(min=0)


def _end_of_last_true(flags: torch.Tensor) -> torch.Tensor:
    """Per row of ``flags`` [N, R], one past its last True position (0 for a row with none)."""
    return (flags.bool() * torch.arange(1, flags.shape[1] + 1, device=flags.device)).amax(dim=1)


def scores_on_last_tokens(scores: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``token_level_scores`` [N, R]: each trajectory's score on its last model token, zero elsewhere."""
    token_level_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    token_level_scores[torch.arange(response_mask.shape[0]), last_model_token(response_mask)] = torch.tensor(
        scores, dtype=torch.float32
    )
    return token_level_scores * response_mask


def trim_response_padding(batch: TensorDict) -> TensorDict:
    """The batch with its response-aligned fields cut to the longest valid response in it.

    Responses are padded to ``max_response_length``; a forward pass over the padding is wasted
    work (often most of it once a policy learns to stop early).
    """
    width = max(int(response_extent(batch).max()), 1)
    if width == batch["response_mask"].shape[1]:
        return batch
    trimmed = batch.clone(recurse=False)
    for name in RESPONSE_FIELDS:
        if name in batch.keys():
            trimmed.set(name, batch[name][:, :width])
    return trimmed


def tensors_digest(tensors: Mapping[str, torch.Tensor], *context: str) -> str:
    """sha256 of named tensors (names, dtypes, shapes and bytes, in name order) and ``context``:
    the same values give the same digest whatever the insertion order or memory layout."""
    digest = hashlib.sha256("\x00".join(context).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def split_batch(batch: TensorDict) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """A flat step batch's tensors and its non-tensor columns (as plain lists), each in the batch's key
    order; ``TypeError`` naming the first field that is neither."""
    tensors: dict[str, torch.Tensor] = {}
    columns: dict[str, list] = {}
    for name in batch.keys():
        value = batch.get(name)
        if isinstance(value, torch.Tensor):
            tensors[name] = value
        elif isinstance(value, NonTensorStack):
            columns[name] = list(value.tolist())
        else:
            raise TypeError(f"batch field {name!r} has unsupported type {type(value).__name__}")
    return tensors, columns


def encode_batch(batch: TensorDict) -> bytes:
    """Encode a flat step batch as safetensors bytes (non-tensor columns as JSON in the header)."""
    tensors, columns = split_batch(batch)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = {
        _NON_TENSOR_KEY: json.dumps(columns),
        _BATCH_SIZE_KEY: json.dumps(list(batch.batch_size)),
    }
    return safetensors_save(tensors, metadata=metadata)


def decode_batch(payload: bytes | bytearray | memoryview) -> TensorDict:
    """Decode bytes written by :func:`encode_batch`; raises ``ValueError`` on anything else.

    The tensors are views into ``payload`` when it is a writable buffer (what the storage readers
    return), so a loaded step costs no copy."""
    try:
        tensors, metadata = read_safetensors(payload)
        columns = json.loads(metadata[_NON_TENSOR_KEY])
        batch_size = json.loads(metadata[_BATCH_SIZE_KEY])
        return with_non_tensor_columns(TensorDict(tensors, batch_size=batch_size), columns)
    except Exception as error:  # json, torch and tensordict raise their own types; normalise them
        raise ValueError(f"not a ppoflow batch payload: {error}") from error


def plain_batch(batch: TensorDict) -> tuple | None:
    """``batch`` as plain values to pickle when it crosses a process boundary (Ray's object store):
    the batch size, the key order, each tensor's bytes as a uint8 numpy array with its dtype and shape,
    each non-tensor column as a list; None for a batch that is not flat, not on the CPU or carries
    gradients. :func:`batch_from_plain` rebuilds it.

    Why: pickling a TensorDict pickles every non-tensor value as an object of its own and every tensor
    through torch's storage pickling, which costs far more than the bytes (docs/benchmarks.md); numpy
    arrays go out of band with pickle protocol 5, and a slice of a larger tensor ships its own bytes
    only."""
    try:
        tensors, columns = split_batch(batch)
    except TypeError:
        return None
    if batch.device not in (None, torch.device("cpu")) or any(
        tensor.device.type != "cpu" or tensor.requires_grad for tensor in tensors.values()
    ):
        return None
    arrays = {
        name: (tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))
        for name, tensor in tensors.items()
    }
    return tuple(batch.batch_size), list(batch.keys()), arrays, columns


def batch_from_plain(plain: tuple) -> TensorDict:
    """The batch :func:`plain_batch` took apart; its tensors own their memory (copied once out of the
    received buffers, which may be read-only object-store memory)."""
    batch_size, names, arrays, columns = plain
    batch = TensorDict({}, batch_size=batch_size)
    for name in names:
        if name in arrays:
            data, dtype, shape = arrays[name]
            buffer = torch.from_numpy(data.copy()) if data.size else torch.empty(0, dtype=torch.uint8)
            batch.set(name, buffer.view(dtype).reshape(shape))
        else:
            with_non_tensor_columns(batch, {name: columns[name]})
    return batch


def read_safetensors(payload: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and the ``__metadata__`` of a safetensors buffer, checking every header entry.

    The format is an 8-byte little-endian header length, a JSON header mapping each name to its
    dtype, shape and byte range, then the data. Tensors are ``torch.frombuffer`` views of a writable
    ``payload`` (what the storage readers return); a read-only one (``bytes``) is copied once first,
    as a view must not alias immutable memory; a tensor whose offset is not a multiple of its item
    size is copied. Raises ``ValueError`` naming the first entry that does not fit.

    Why not the safetensors package's readers: ``safetensors.torch.load`` copies every tensor out of
    the buffer (about as long as the read itself, docs/benchmarks.md), and ``safe_open`` maps local files only,
    while the payload here was already read (and hashed) from any fsspec store.
    """
    payload = memoryview(payload).cast("B")
    if payload.readonly:
        payload = memoryview(bytearray(payload))
    if len(payload) < 8:
        raise ValueError("truncated safetensors header")
    data_start = 8 + int.from_bytes(payload[:8], "little")
    if len(payload) < data_start:
        raise ValueError("truncated safetensors header")
    header = json.loads(bytes(payload[8:data_start]))
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name!r}: unsupported dtype {entry.get('dtype')!r}")
        shape, (begin, end) = list(entry["shape"]), entry["data_offsets"]
        count = math.prod(shape)
        offset = data_start + begin
        if begin < 0 or end - begin != count * dtype.itemsize or data_start + end > len(payload):
            raise ValueError(
                f"tensor {name!r}: bytes {begin}..{end} do not hold {dtype} {shape} "
                f"within the {len(payload) - data_start}-byte data section"
            )
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        tensor = torch.frombuffer(payload, dtype=dtype, count=count, offset=offset).view(shape)
        tensors[name] = tensor.clone() if offset % dtype.itemsize else tensor
    return tensors, metadata
