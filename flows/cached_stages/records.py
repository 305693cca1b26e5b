"""The step cache as Prefect task-result caching: what Prefect stores, reads and deserializes.

A cached stage task's cache key is the entry's marker path relative to ``dump_dir``, its result storage
``dump_dir`` itself (:class:`StepCacheStorage`); the record Prefect persists is a
:class:`~ppoflow.storage.step_cache.entry_check.StageRecord` serialized by :class:`ManifestSerializer` as the entry's
marker only. Prefect's metadata for an entry is derived from the marker (:class:`DerivedRecords`), never stored, so
nothing in a shared cache can choose a serializer. Reading a replay's record back is loading the entry
(:class:`~ppoflow.storage.step_cache.entry_check.EntryCheck`). Details: docs/step_cache.md (Prefect caching, Security).
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any, Literal

from prefect.cache_policies import CacheKeyFnPolicy
from prefect.filesystems import WritableFileSystem
from prefect.results import ResultRecordMetadata
from prefect.serializers import Serializer
from pydantic import Field

from ppoflow.storage.fs import atomic_write, join, open_fs, write_with_retries
from ppoflow.storage.step_cache.entry_check import EntryCheck, StageRecord, describe
from ppoflow.storage.step_cache.manifest import decode_manifest, parse_marker_key
from ppoflow.storage.step_cache.store import CacheWriteError, StepCache, encode_manifest

logger = logging.getLogger(__name__)


class ManifestSerializer(Serializer):
    """Persists a :class:`StageRecord` as its manifest (the marker) and reads a marker back as one: with a
    ``check``, the whole entry, loaded and checked (:meth:`EntryCheck.load`)."""

    type: Literal["ppoflow-step-manifest"] = "ppoflow-step-manifest"
    check: EntryCheck | None = None

    def dumps(self, obj: Any) -> bytes:
        if not isinstance(obj, StageRecord) or obj.manifest is None:
            # Refusing leaves Prefect's transaction uncommitted: no marker, no record, nothing valid.
            raise ValueError("no cache entry to commit (the payload was not written)")
        return encode_manifest(obj.manifest)

    def loads(self, blob: bytes) -> StageRecord:
        if self.check is not None:
            return self.check.load(blob)
        manifest = decode_manifest(blob)
        describe(manifest)
        return StageRecord(fields=None, metrics=manifest.get("metrics", {}), manifest=manifest)


class StepCacheStorage(WritableFileSystem):
    """Prefect's result storage for step-cache entries: the ``dump_dir`` (any fsspec URL). What Prefect
    persists here is an entry's marker, written atomically and with retries like every other cache file
    (Prefect's own file blocks write in place, so a crash could leave half a marker)."""

    _block_type_name = "ppoflow step cache"
    _description = "A ppoflow step cache root (skip.<stage>.dump_dir): payloads and their commit markers."

    basepath: str = Field(description="The cache root, a local path or fsspec URL.")
    settings: dict = Field(default_factory=dict, description="fsspec options (endpoint; no credentials).")

    def read_path(self, path: str, _sync: bool | None = None) -> bytes:
        fs, root = open_fs(self.basepath, self.settings)
        return fs.cat_file(join(root, path))

    def write_path(self, path: str, content: bytes, _sync: bool | None = None) -> str:
        fs, root = open_fs(self.basepath, self.settings)
        url = join(root, path)
        write_with_retries(url, lambda: atomic_write(fs, url, content), retries=3, backoff_s=0.5, error=CacheWriteError)
        return url

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return self.write_path(path, content)


class DerivedRecords(WritableFileSystem):
    """The cache policy's ``key_storage``: Prefect's record of an entry, derived from its marker.

    Reading the record of a key validates the marker at that key (it must decode as a manifest of
    this step and stage) and returns metadata that names :class:`ManifestSerializer` (with this replay's
    ``check``, so that reading the record loads and checks the entry) and the marker itself as the
    result; an invalid or absent marker raises, which Prefect reads as "no record". Writing stores
    nothing: the marker Prefect has just written is the record. So there is no Prefect-owned file in the
    cache to edit, poison or delete.
    """

    _block_type_name = "ppoflow step cache records"

    basepath: str
    settings: dict = Field(default_factory=dict)
    storage_block_id: uuid.UUID | None = None
    check: EntryCheck | None = None

    def read_path(self, path: str, _sync: bool | None = None) -> bytes:
        config_path, step, stage = parse_marker_key(path)
        StepCache(join(self.basepath, config_path), stage=stage, storage_options=self.settings).manifest(step)
        return ResultRecordMetadata(
            storage_key=path,
            expiration=None,
            serializer=ManifestSerializer(check=self.check),
            storage_block_id=self.storage_block_id,
        ).dump_bytes()

    def write_path(self, path: str, content: bytes, _sync: bool | None = None) -> str:
        return path

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return self.write_path(path, content)


class PrefectStore:
    """Where Prefect keeps the records of one cache root, and the task options that use it."""

    def __init__(self, dump_dir: str, settings: dict):
        self.result_storage = StepCacheStorage(basepath=dump_dir, settings=settings)
        # Prefect requires a saved block for result storage; saving also makes its keys relative, so the
        # cache stays valid when the folder is mounted elsewhere. One block per root and options.
        name = hashlib.sha256(f"{dump_dir}|{sorted(settings.items())}".encode()).hexdigest()[:16]
        self.result_storage.save(f"ppoflow-cache-{name}", overwrite=True)
        self.key_storage = DerivedRecords(
            basepath=dump_dir, settings=settings, storage_block_id=self.result_storage._block_document_id
        )

    def task_options(self, key: str, *, check: EntryCheck | None = None) -> dict:
        """``with_options`` arguments that make a stage task a persisted Prefect cache entry at ``key``:
        without a ``check``, the body runs and its result replaces any entry there; with one, the entry is
        replayed once it passes the check, and is never retried (a rejected entry stays rejected).

        The key becomes the task run's cache key, which the UI shows (Prefect 3 leaves it empty), and
        the task run's logs say which entry it replays or is about to write."""
        url = join(self.result_storage.basepath, key)

        def step_key(context, parameters) -> str:
            context.task_run.cache_key = key
            if check is None:
                logger.info("no valid cache entry to replay: computing, then writing %s", url)
            else:
                logger.info("checking the cache entry %s, to replay it", url)
            return key

        records = self.key_storage if check is None else self.key_storage.model_copy(update={"check": check})
        policy = CacheKeyFnPolicy(cache_key_fn=step_key).configure(key_storage=records)
        replay = {} if check is None else {"retries": 0}
        return {
            "cache_policy": policy,
            "result_storage": self.result_storage,
            "result_serializer": ManifestSerializer(),
            "persist_result": True,
            "cache_result_in_memory": False,
            "refresh_cache": check is None,
            **replay,
        }
