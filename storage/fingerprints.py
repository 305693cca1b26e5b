"""Identities of a model and a tokenizer directory, for telling whether a cached rollout came from them.

A path says nothing (a folder is moved, a path reused for another checkpoint), and hashing every weight
of a large model at each start costs as much as reading it. So a model's identity is the sha256 of its
``config.json`` and, for each weight file, its name, its size and samples of its bytes (the first and the
last MiB, and one in the middle): two checkpoints of one architecture have the same names and sizes but
different bytes nearly everywhere, so the samples tell them apart for the price of a few MiB per file. A
tokenizer's files are small, so they are hashed whole.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tensordict import TensorDict

from ppoflow.storage.batch import NON_TENSOR_FIELDS, tensors_digest
from ppoflow.storage.fs import open_fs

_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def rollout_identity(sampling: dict, models: dict) -> dict:
    """What a cached rollout must have been sampled with to be replayed: the sampling settings that shape
    the samples (``sampling`` without its seed) and the model and tokenizer (:func:`model_identities`)."""
    return {"sampling": {name: value for name, value in sampling.items() if name != "seed"}, **models}


def model_identities(model_url: str, tokenizer_url: str, dtype: str) -> dict:
    """``{"model": ..., "tokenizer": ..., "dtype": ...}``: the identities of a model and a tokenizer directory,
    and the dtype the model samples in (``rollout.dtype``: the same weights sample differently in another)."""
    return {"model": model_identity(model_url), "tokenizer": tokenizer_identity(tokenizer_url), "dtype": dtype}


def model_identity(url: str) -> str:
    """``sha256:...`` of a Hugging Face model directory's config and sampled weight bytes."""
    fs, root = open_fs(url)
    digest = hashlib.sha256(fs.cat_file(f"{root}/config.json"))
    for path in sorted(fs.find(root)):
        if path.endswith(_WEIGHT_SUFFIXES):
            size = fs.size(path)
            digest.update(f"{path[len(root) :]}:{size}".encode())
            for start in sorted({0, max(size // 2 - _SAMPLE_BYTES // 2, 0), max(size - _SAMPLE_BYTES, 0)}):
                digest.update(fs.cat_file(path, start=start, end=min(start + _SAMPLE_BYTES, size)))
    return f"sha256:{digest.hexdigest()}"


def tokenizer_identity(url: str) -> str:
    """``sha256:...`` of a tokenizer directory's files."""
    fs, root = open_fs(url)
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if fs.exists(f"{root}/{name}"):
            digest.update(name.encode() + b"\0" + fs.cat_file(f"{root}/{name}"))
    return f"sha256:{digest.hexdigest()}"


def batch_fingerprint(batch: TensorDict, **context: Any) -> str:
    """A checksum of the batch's tensor fields (and ``context``, such as the weights that compute on it): a
    cached stage result is only reused for exactly the input it was computed from."""
    tensors = batch.exclude(*NON_TENSOR_FIELDS)
    return tensors_digest({name: tensors[name] for name in tensors.keys()}, repr(sorted(context.items())))
