"""The run directory's lock: one run at a time writes a run directory (local or ``s3://``).

A run claims ``{run_dir}/run.lock`` at start and removes it when it ends; the file is a JSON :class:`Owner` record
(host, pid and its start time, flow run, start, heartbeat) checked before use, never unpickled. Claiming is one
atomic create (``O_EXCL`` locally, ``If-None-Match: *`` on S3); a stale lock (dead owner pid, old heartbeat past
``stale_after_s``, or not an owner record) is taken over with a warning, by compare-and-swap (``flock`` locally,
``If-Match`` on S3). Details: docs/reliability.md (A run directory is owned by one run at a time).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from ppoflow.storage.fs import atomic_write, join, open_fs

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
FORMAT_VERSION = 1
HEARTBEAT_S = 10.0
"""How often a live owner refreshes its lock's heartbeat."""
STALE_AFTER_S = 60.0
"""A lock from another host whose heartbeat is older than this belongs to a run that is gone."""
MAX_LOCK_BYTES = 64 << 10
_TOKEN = re.compile(r"[0-9a-f]{32}")
_YEAR_5000 = 95_617_584_000.0  # a timestamp that datetime can still print


@dataclass(frozen=True)
class Owner:
    """Who holds a run directory; ``token`` tells this claim from any other, even of the same process."""

    token: str
    host: str
    pid_space: str | None
    """Where ``pid`` means that process: the kernel's boot id and pid namespace (None off Linux). Containers
    may share a host name, not a pid space; a lock from another pid space is judged by its heartbeat."""
    pid: int
    process_start: str | None
    """The owner process's start in clock ticks since boot (None off Linux): a reused pid starts later."""
    started: float
    heartbeat: float
    flow_run_id: str | None
    flow_run_name: str | None

    @classmethod
    def this_process(cls, flow_run_id: str | None = None, flow_run_name: str | None = None) -> Owner:
        now = time.time()
        return cls(
            uuid.uuid4().hex,
            socket.gethostname(),
            pid_space(),
            os.getpid(),
            process_start(os.getpid()),
            now,
            now,
            flow_run_id,
            flow_run_name,
        )

    def describe(self) -> str:
        """One line for a person: who, where, since when, last seen when."""
        flow_run = f", flow run {self.flow_run_name!r} ({self.flow_run_id})" if self.flow_run_id else ""
        return (
            f"pid {self.pid} on host {self.host!r}{flow_run}, started {_clock(self.started)}, "
            f"last heartbeat {_clock(self.heartbeat)}"
        )

    def encode(self) -> bytes:
        return json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> Owner:
        """The owner a lock file records; ``ValueError`` says why it is not an owner record."""
        try:
            record = json.loads(data)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        fields = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(record, dict) or set(record) != fields | {"format_version"}:
            raise ValueError(f"not a JSON object with exactly the keys {sorted(fields | {'format_version'})}")
        if record.pop("format_version") != FORMAT_VERSION:
            raise ValueError(f"format_version is not {FORMAT_VERSION}")
        owner = cls(**record)
        checks = {
            "token": isinstance(owner.token, str) and bool(_TOKEN.fullmatch(owner.token)),
            "host": isinstance(owner.host, str) and 0 < len(owner.host) <= 255,
            "pid_space": owner.pid_space is None or isinstance(owner.pid_space, str),
            "pid": type(owner.pid) is int and owner.pid > 0,
            "process_start": owner.process_start is None or isinstance(owner.process_start, str),
            "started": _is_time(owner.started),
            "heartbeat": _is_time(owner.heartbeat),
            "flow_run_id": owner.flow_run_id is None or isinstance(owner.flow_run_id, str),
            "flow_run_name": owner.flow_run_name is None or isinstance(owner.flow_run_name, str),
        }
        if bad := [name for name, ok in checks.items() if not ok]:
            raise ValueError(f"invalid {', '.join(bad)}")
        return owner

    def gone_because(self, stale_after_s: float) -> str:
        """Why this owner's run is over ("" while it may still run)."""
        if self.host == socket.gethostname() and self.pid_space == pid_space():
            if self.process_start is None:  # no /proc: the pid alone
                return "" if _pid_runs(self.pid) else f"pid {self.pid} is not running"
            running = process_start(self.pid)
            if running is None:
                return f"pid {self.pid} is not running"
            if running != self.process_start:
                return f"pid {self.pid} is another process now (a reused pid)"
            return ""
        age = time.time() - self.heartbeat
        return f"its heartbeat is {age:.0f} s old (more than {stale_after_s:.0f} s)" if age > stale_after_s else ""


class RunDirectoryBusy(Exception):
    """Another live run owns ``run_dir``; ``owner`` says who."""

    def __init__(self, run_dir: str, owner: Owner):
        super().__init__(run_dir, owner)
        self.run_dir = run_dir
        self.owner = owner

    def __str__(self) -> str:
        return f"run directory {self.run_dir} is owned by another run: {self.owner.describe()}"


class RunLock:
    """A held lock on a run directory; :meth:`release` (or leaving ``with``) gives it up."""

    def __init__(self, run_dir: str, store: _LockStore, owner: Owner, version, heartbeat_s: float):
        self.run_dir = run_dir
        self.owner = owner
        self._store = store
        self._version = version
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_s,), daemon=True, name=f"run-lock-heartbeat {run_dir}"
        )
        self._heartbeat.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file, unless another run has taken it over meanwhile."""
        self._stop.set()
        self._heartbeat.join()
        with self._store.guard():
            current = self._store.read()
            if current is not None and current[0] == self.owner.encode():  # still the record this run wrote
                self._store.remove()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            owner = dataclasses.replace(self.owner, heartbeat=time.time())
            try:
                with self._store.guard():
                    version = self._store.replace(owner.encode(), self._version)
            except Exception as error:  # a storage outage: the next beat tries again
                logger.warning("could not refresh the heartbeat of %s: %r", self._store.url, error)
                continue
            if version is None:
                logger.error(
                    "%s was taken over by another run; this run no longer owns %s", self._store.url, self.run_dir
                )
                return
            self.owner, self._version = owner, version


def claim(
    run_dir: str,
    *,
    flow_run_id: str | None = None,
    flow_run_name: str | None = None,
    storage_options: dict | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    stale_after_s: float = STALE_AFTER_S,
) -> RunLock:
    """Take the lock of ``run_dir`` for this process (taking over a stale one, with a warning) and start
    its heartbeat; :class:`RunDirectoryBusy` naming the owner when a live run holds it."""
    store = _LockStore.open(join(run_dir, LOCK_FILE), storage_options)
    while True:
        owner = Owner.this_process(flow_run_id, flow_run_name)
        version = store.create(owner.encode())
        if version is not None:
            return RunLock(run_dir, store, owner, version, heartbeat_s)
        with store.guard():
            current = store.read()
            if current is None:  # released meanwhile: claim afresh
                continue
            data, version = current
            try:
                held_by = Owner.decode(data)
                why = held_by.gone_because(stale_after_s)
            except ValueError as error:
                held_by, why = None, f"it is not an owner record ({error})"
            if held_by is not None and not why:
                raise RunDirectoryBusy(run_dir, held_by)
            version = store.replace(owner.encode(), version)
        if version is not None:
            logger.warning(
                "taking over the lock of run directory %s: %s (%s)",
                run_dir,
                held_by.describe() if held_by else "unreadable lock file",
                why,
            )
            return RunLock(run_dir, store, owner, version, heartbeat_s)


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc``); None when it is not running
    (a zombie, killed but not yet reaped, is not) or this system has no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # stat(5) after the command name: state is field 3
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()  # field 22: starttime


def pid_space() -> str | None:
    """This process's boot id and pid namespace (Linux); None without ``/proc``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


class _LockStore:
    """The lock file's atomic operations on one filesystem; ``version`` tells one write of it from another."""

    def __init__(self, fs: AbstractFileSystem, path: str, url: str):
        self.fs, self.path, self.url = fs, path, url

    @staticmethod
    def open(url: str, storage_options: dict | None) -> _LockStore:
        fs, path = open_fs(url, storage_options)
        return (_LocalLockStore if isinstance(fs, LocalFileSystem) else _ObjectLockStore)(fs, path, url)

    def create(self, data: bytes):
        """Write the lock file if there is none; its version, or None when one exists."""
        raise NotImplementedError

    def read(self) -> tuple[bytes, object] | None:
        """The lock file's bytes and version; None when there is none."""
        raise NotImplementedError

    def replace(self, data: bytes, version):
        """Overwrite the lock file if it is still at ``version``; the new version, or None when it is not."""
        raise NotImplementedError

    def remove(self) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            pass

    @contextmanager
    def guard(self):
        """Where a read and a replace must not interleave with another process's (a no-op by default)."""
        yield

    def _checked_size(self, size: int) -> None:
        if size > MAX_LOCK_BYTES:
            raise ValueError(f"{self.url} has {size} bytes, more than a lock file's {MAX_LOCK_BYTES}")


class _LocalLockStore(_LockStore):
    """Create: ``O_EXCL``. Replace and remove run under an exclusive ``flock`` of the run directory (the kernel
    drops it when its holder dies), so a version is the file's content itself."""

    def create(self, data: bytes):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with self.guard():  # no reader sees the file before it is whole
            try:
                descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(descriptor, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
        return data

    def read(self):
        try:
            with open(self.path, "rb") as file:
                self._checked_size(os.fstat(file.fileno()).st_size)
                data = file.read()
        except FileNotFoundError:
            return None
        except ValueError:
            data = b""  # too big to be a lock: not an owner record
        return data, data

    def replace(self, data: bytes, version):
        current = self.read()
        if current is None or current[1] != version:
            return None
        atomic_write(self.fs, self.path, data)
        return data

    @contextmanager
    def guard(self):
        descriptor = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # closing drops the flock


class _ObjectLockStore(_LockStore):
    """Create: a PUT with ``If-None-Match: *``; replace: a PUT with ``If-Match`` the ETag read (S3). A version
    is the object's ETag."""

    def create(self, data: bytes):
        try:
            written = self.fs.pipe_file(self.path, data, mode="create")
        except FileExistsError:
            return None
        return _etag(written)

    def read(self):
        from s3fs.utils import FileExpired  # here, not at the top: a run on local disk never imports s3fs

        while True:
            try:
                with self.fs.open(self.path, "rb") as file:  # s3fs reads with If-Match: the bytes of that ETag
                    version = file.details.get("ETag")
                    self._checked_size(file.size)
                    return file.read(), version
            except FileNotFoundError:
                return None
            except ValueError:
                return b"", version  # too big to be a lock: not an owner record
            except FileExpired:  # rewritten between s3fs's HEAD and GET (a heartbeat, a takeover): read again
                continue

    def replace(self, data: bytes, version):
        conditions = {"IfMatch": version} if "s3" in self.fs.protocol and version else {}
        try:
            written = self.fs.pipe_file(self.path, data, **conditions)
        except FileNotFoundError:  # removed meanwhile
            return None
        except OSError as error:
            if conditions and error.errno == errno.EINVAL:  # s3fs's PreconditionFailed: changed meanwhile
                return None
            raise
        return _etag(written)


def _etag(written) -> str | None:
    return written.get("ETag") if isinstance(written, dict) else None


def _is_time(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value < _YEAR_5000


def _clock(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True
