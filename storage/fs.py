"""Small fsspec helpers shared by the rollout cache and checkpoints.

Local paths are normalised once; :func:`open_fs` turns off s3fs's listing cache; :func:`atomic_write` makes local
writes atomic and :func:`remove_stale_temp_files` cleans up after interrupted ones; :func:`read_with_sha256` hashes
while it reads; :func:`files_by_directory` lists a tree with one recursive listing; :func:`path_problem` names a path
no read or write should meet (symlink loop, dangling symlink, FIFO, special file). Why each exists:
docs/step_cache.md#where-it-lives.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import stat
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import fsspec
import numpy
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

logger = logging.getLogger(__name__)

_LOCAL_PROTOCOLS = (None, "file", "local")
_HASH_CHUNK = 8 << 20
_S3_PROTOCOLS = ("s3", "s3a")
_TEMP_FILE = re.compile(r"\..+\.[0-9a-f]{32}\.tmp")
"""The names :func:`atomic_write` gives its temp files: ``.{name}.{uuid4 hex}.tmp``."""


def normalize_url(url: str) -> str:
    """Return ``url`` with local paths made absolute (``~`` expanded); other URLs unchanged.

    ``file://`` URLs become plain absolute paths, so a local location has one spelling. Symlinks are
    resolved, except a loop or a dangling link: left as given, for :func:`path_problem` to name.
    """
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in _LOCAL_PROTOCOLS:
        absolute = os.path.abspath(os.path.expanduser(path))
        return absolute if _broken_link(absolute) else os.path.realpath(absolute)
    return url.rstrip("/")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face hub id: ``organisation/name``."""


def is_hub_id(path: str) -> bool:
    """Whether a model path means a Hugging Face hub model, as transformers reads it: ``org/name`` where no such
    file or directory exists here (``Qwen/Qwen3-8B`` is a hub id, ``./Qwen/Qwen3-8B`` or an existing ``Qwen/``
    folder a path)."""
    return bool(HUB_ID.fullmatch(path)) and not os.path.exists(path)


_SPECIAL_FILES = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def path_problem(url: str, *, want: str = "file") -> str | None:
    """Why the local ``url`` cannot be used as a ``want`` (``"file"`` or ``"directory"``), as the rest of a
    sentence that begins with the path: ``"is a symlink loop"``, ``"is a dangling symlink to X"``, ``"is a
    FIFO, not a file"``, ``"is a file, not a directory"``. None when it can, when it does not exist yet
    (whether it must is the caller's rule), and for remote URLs. Never follows a FIFO's read."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol not in _LOCAL_PROTOCOLS:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    broken = _broken_link(path)
    if broken is not None:
        return broken
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as error:  # ENOTDIR: a file on the way; EACCES
        return f"cannot be used: {error.strerror}"
    kind = _SPECIAL_FILES.get(stat.S_IFMT(mode))
    if kind is not None:
        return f"is {kind}, not a {want}"
    if want == "file" and stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if want == "directory" and not stat.S_ISDIR(mode):
        return "is a file, not a directory"
    return None


def _broken_link(path: str) -> str | None:
    """``"is a symlink loop"`` or ``"is a dangling symlink to X"`` (or lies under one) for the absolute
    local ``path``; None otherwise."""
    try:
        os.stat(path)
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is a symlink loop"
        if error.errno != errno.ENOENT:
            return None
    dangling = next(
        (link for link in (path, *map(str, Path(path).parents)) if os.path.islink(link) and not os.path.exists(link)),
        None,
    )
    if dangling is None:
        return None
    target = os.readlink(dangling)
    return (
        f"is a dangling symlink to {target}"
        if dangling == path
        else f"lies under {dangling}, a dangling symlink to {target}"
    )


def open_fs(url: str, storage_options: dict | None = None) -> tuple[AbstractFileSystem, str]:
    """Return the filesystem for ``url`` and the path inside it.

    For S3 the listings cache is off (``use_listings_cache=False``) unless ``storage_options``
    sets it explicitly.
    """
    url = normalize_url(url)
    options = dict(storage_options or {})
    if fsspec.core.split_protocol(url)[0] in _S3_PROTOCOLS:
        options.setdefault("use_listings_cache", False)
    return fsspec.core.url_to_fs(url, **options)


def join(*parts: str) -> str:
    """Join URL or path parts with single ``/`` separators (``join("s3://b/", "x")`` is ``s3://b/x``)."""
    head, *tail = parts
    return "/".join([head.rstrip("/"), *(part.strip("/") for part in tail)])


def read_with_sha256(fs: AbstractFileSystem, path: str) -> tuple[memoryview, str]:
    """The whole file at ``path`` (a writable buffer) and the sha256 hex digest of what was read.

    Each chunk is hashed on a helper thread while the next one is read into the same buffer (hashlib
    and file reads release the GIL), so verifying costs about as much as reading. The buffer is
    allocated uninitialised (a ``bytearray`` would first zero it, which costs as much as the read).
    Raises ``FileNotFoundError`` / ``OSError`` as ``fs`` does.
    """
    size = fs.size(path)
    view = memoryview(numpy.empty(size, dtype=numpy.uint8)).cast("B")
    digest = hashlib.sha256()
    done = 0
    hashing: Future | None = None
    with fs.open(path, "rb") as file, ThreadPoolExecutor(max_workers=1) as hasher:
        while done < size:
            count = file.readinto(view[done : done + _HASH_CHUNK])
            if not count:
                break
            if hashing is not None:
                hashing.result()  # updates must stay in order
            hashing = hasher.submit(digest.update, view[done : done + count])
            done += count
        if hashing is not None:
            hashing.result()
    return view[:done], digest.hexdigest()


def files_by_directory(fs: AbstractFileSystem, root_path: str, depth: int) -> dict[tuple[str, ...], dict[str, int]]:
    """Files exactly ``depth`` directories below ``root_path``, as ``{directory parts: {name: size}}``;
    one recursive ``find`` without ``maxdepth``. A missing root has no files."""
    try:
        found = fs.find(root_path, detail=True)
    except FileNotFoundError:
        return {}
    prefix = root_path.rstrip("/") + "/"
    grouped: dict[tuple[str, ...], dict[str, int]] = {}
    for path, info in found.items():
        parts = path[len(prefix) :].split("/") if path.startswith(prefix) else []
        if len(parts) == depth + 1:
            grouped.setdefault(tuple(parts[:-1]), {})[parts[-1]] = info["size"]
    return grouped


def remove_if_present(fs: AbstractFileSystem, path: str) -> None:
    """Delete the file at ``path``; one that is already gone is fine."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def atomic_write(fs: AbstractFileSystem, path: str, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    Local: write a hidden sibling temp file, fsync it, rename it over ``path`` and fsync the
    directory (so the rename survives a power loss). Any other filesystem: one ``pipe`` (a PUT,
    which object stores apply atomically; botocore takes bytes, not a memoryview).
    """
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, bytes(data))
        return
    directory, name = os.path.split(fs._strip_protocol(path))
    try:
        fs.makedirs(directory, exist_ok=True)
    except OSError as error:  # say why, when the reason is a symlink loop, a FIFO, ... where the directory goes
        problem = path_problem(directory, want="directory")
        if problem is None:
            raise
        raise NotADirectoryError(error.errno, f"{directory} {problem}") from None
    temp_path = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        with fs.open(temp_path, "wb") as temp_file:
            temp_file.write(data)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.replace(temp_path, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(temp_path):
            os.remove(temp_path)
        raise
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


STALE_TEMP_FILE_S = 3600.0
"""A temp file of :func:`atomic_write` left this long belongs to an interrupted write, not a slow one."""


def remove_stale_temp_files(fs: AbstractFileSystem, root: str, older_than_s: float = STALE_TEMP_FILE_S) -> list[str]:
    """Delete the temp files of interrupted :func:`atomic_write` calls anywhere under ``root`` that were
    last modified more than ``older_than_s`` ago (a younger one may belong to a writer still at work);
    return their paths. Only local filesystems write temp files; elsewhere there is nothing to do."""
    if not isinstance(fs, LocalFileSystem):
        return []
    cutoff = time.time() - older_than_s
    removed = []
    for directory, _, names in os.walk(fs._strip_protocol(root)):
        for name in filter(_TEMP_FILE.fullmatch, names):
            path = os.path.join(directory, name)
            try:
                if os.stat(path).st_mtime < cutoff:
                    os.remove(path)
                    removed.append(path)
            except FileNotFoundError:  # its writer renamed it, or another cleaner removed it, meanwhile
                continue
    if removed:
        logger.info("removed %d temp file(s) of interrupted writes under %s", len(removed), root)
    return removed


class StorageError(Exception):
    """A problem with one stored file; ``path`` names it and ``reason`` says what is wrong."""

    def __init__(self, path: str, reason: str):
        super().__init__(path, reason)  # both in args, so the error survives pickling (Ray)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class StorageWriteError(StorageError):
    """A write that still failed after its retries; ``path`` is the file being written."""


def write_with_retries(
    url: str, write, *, retries: int, backoff_s: float, error: type[StorageWriteError] = StorageWriteError
) -> None:
    """Run ``write()``; retry a failure ``retries`` times (sleeping ``backoff_s * 2**k``), then raise ``error``.

    fsspec backends raise their own error types (botocore's connection errors are not OSError),
    so every failure is retried and finally reported.
    """
    for attempt in range(1, retries + 2):
        try:
            write()
            return
        except Exception as failure:
            if attempt == retries + 1:
                raise error(url, f"write failed after {attempt} attempts: {failure!r}") from failure
            logger.warning("writing %s failed (attempt %d of %d): %r; retrying", url, attempt, retries + 1, failure)
            time.sleep(backoff_s * 2 ** (attempt - 1))
