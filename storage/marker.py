"""Commit markers: how a group of files becomes valid together, for the step cache and for checkpoints.

A writer writes its files first (each atomically, see :func:`storage.fs.atomic_write`) and then one small JSON
*marker* listing every file with its size and sha256: a reader sees either no marker or one whose files are all
there. :meth:`MarkerFormat.decode` checks the marker's shape before any field is used, :func:`size_problem` is the
cheap size-only check, and :func:`read_verified` checks a listed file's size before reading and its sha256 while
reading. Details: docs/step_cache.md#where-it-lives.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fsspec import AbstractFileSystem

from ppoflow.storage.fs import StorageError, read_with_sha256

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


class MarkerError(StorageError):
    """A listed file that does not match its marker entry; ``path`` names it."""


def file_entry(data: bytes | memoryview) -> dict:
    """The marker entry of a file holding ``data``: ``{"bytes": size, "sha256": hex digest}``."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@dataclass(frozen=True)
class MarkerFormat:
    """One kind of marker: its format version and the typed fields it carries besides ``files``.

    Every marker is a JSON object ``{"format_version": V, "files": {name: entry}, **fields}``; fields
    not declared here may be present (free metadata) but are never needed to read the files.
    """

    version: int
    fields: Mapping[str, type]

    def encode(self, files: Mapping[str, dict], **fields) -> bytes:
        """The marker's bytes (sorted-key JSON); what :meth:`decode` would reject raises ``ValueError`` now."""
        data = json.dumps(
            {"format_version": self.version, "files": dict(files), **fields}, sort_keys=True, ensure_ascii=False
        ).encode("utf-8")
        self.decode(data)
        return data

    def decode(self, data: bytes | memoryview) -> dict:
        """Parse and check a marker; ``ValueError`` says what is wrong."""
        marker = json.loads(bytes(data))  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if not isinstance(marker, dict):
            raise ValueError(f"marker is a JSON {type(marker).__name__}, not an object")
        if marker.get("format_version") != self.version:
            raise ValueError(f"unsupported format_version {marker.get('format_version')!r} (expected {self.version})")
        for key, expected in {**self.fields, "files": dict}.items():
            value = marker.get(key)
            if isinstance(value, bool) or not isinstance(value, expected):
                raise ValueError(f"marker field {key!r} is {value!r}, expected {expected.__name__}")
        for name, entry in marker["files"].items():
            if not _FILE_NAME.fullmatch(name) or ".." in name.split("/"):
                raise ValueError(f"marker lists an unsafe file name {name!r}")
            if not (
                isinstance(entry, dict)
                and set(entry) == {"bytes", "sha256"}
                and type(entry["bytes"]) is int
                and entry["bytes"] >= 0
                and isinstance(entry["sha256"], str)
                and _SHA256.fullmatch(entry["sha256"])
            ):
                raise ValueError(f"marker entry of {name!r} is {entry!r}, expected {{bytes: int >= 0, sha256: hex}}")
        return marker


def size_problem(sizes: Mapping[str, int | None], files: Mapping[str, dict]) -> str:
    """Why the listed ``files`` do not match the sizes found (None = absent); "" when they all match."""
    for name, entry in files.items():
        size = sizes.get(name)
        if size is None:
            return f"missing {name}"
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, {entry['bytes']} recorded"
    return ""


def read_verified(
    fs: AbstractFileSystem,
    path: str,
    entry: dict,
    *,
    error: type[StorageError] = MarkerError,
    max_bytes: int | None = None,
) -> memoryview:
    """The file at ``path`` if it has the entry's size and sha256; ``error(path, reason)`` otherwise.

    The size is checked before reading, so a file that grew (or a sparse file of any size) is refused
    without allocating or reading it; ``max_bytes`` also refuses an entry that records more than that.
    """
    if max_bytes is not None and entry["bytes"] > max_bytes:
        raise error(path, f"{entry['bytes']} bytes recorded, more than the {max_bytes} allowed")
    try:
        size = fs.size(path)
        if size != entry["bytes"]:
            raise error(path, f"size {size} != {entry['bytes']} recorded")
        data, digest = read_with_sha256(fs, path)
    except FileNotFoundError as missing:
        raise error(path, "missing file") from missing
    except OSError as unreadable:
        raise error(path, f"unreadable: {unreadable}") from unreadable
    if len(data) != entry["bytes"] or digest != entry["sha256"]:
        raise error(path, f"checksum sha256:{digest} != sha256:{entry['sha256']} recorded")
    return data
