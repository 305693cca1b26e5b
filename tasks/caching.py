"""Step-keyed caching of stage results, done as Prefect task-result caching (verl's SkipManager).

For a stage with ``skip.<stage>.enable`` and the current step in ``skip.<stage>.steps``, the stage
task runs with a Prefect cache policy whose key is the step directory's commit marker,
``{experiment}_{project}/GBS.._N.._in.._out../{step}/meta.json``, and whose result storage is the
cache root ``dump_dir`` itself (:class:`StepCacheStorage`):

* the task body writes the stage's tensors as the payload (``storage.rollout_cache.StepCache``) and
  returns a :class:`StageRecord`; Prefect then persists the record with :class:`ManifestSerializer`,
  whose bytes *are* the marker ``meta.json`` (a small JSON manifest with the payload's checksum),
  written atomically. So the payload is written first and the marker last, and no tensor is ever
  inflated into a Prefect record;
* on a later call with the same key, in this run or any other process that reads the store, the
  task run is ``Cached``, its body does not run, and the record comes back without tensors; the
  flow then loads (and checksums) the payload through :class:`StepCache`.

The marker is the source of truth, and Prefect's own record of an entry is *derived* from it rather
than stored (:class:`DerivedRecords`, the cache policy's ``key_storage``). A stored Prefect record
names the serializer and the file that Prefect deserializes a result with; anyone able to write
into a shared cache folder or bucket could then make every later run unpickle a file of their
choice. Here nothing read from the cache chooses how it is deserialized: the serializer
(:class:`ManifestSerializer`, JSON only) and the payload location are fixed by this code, and an
entry whose marker does not validate does not exist for Prefect either.

Before calling the task, the flow asks :meth:`StageCache.plan` which step to use (verl's ``cache`` /
``repeat`` rules over *valid* entries only); when none is usable the call is made with
``refresh_cache=True`` so a stale record can never shadow a regeneration. A damaged entry found at
load time is reported and the stage is recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from prefect.results import ResultRecordMetadata
from prefect.cache_policies import CacheKeyFnPolicy
from prefect.filesystems import WritableFileSystem
from prefect.serializers import Serializer
from pydantic import Field
from tensordict import TensorDict

from ppoflow.configs.schema import PPOConfig, SkipStageConfig
from ppoflow.storage.batch import NON_TENSOR_FIELDS, tensors_digest
from ppoflow.storage.fs import atomic_write, join, normalize_url, open_fs, write_with_retries
from ppoflow.storage.rollout_cache import CacheWriteError, StepCache, config_dir, marker_name, parse_marker_key

logger = logging.getLogger(__name__)


@dataclass
class StageRecord:
    """What a stage task returns: the fields it adds to the batch and its metrics.

    After a real run ``fields`` holds the tensors; a record read back from the cache has
    ``fields=None`` and the ``manifest`` of the step entry to load them from. ``manifest`` is None
    when nothing was dumped (caching off, or the dump failed).
    """

    fields: TensorDict | None
    metrics: dict[str, float] = field(default_factory=dict)
    manifest: dict | None = None


class ManifestSerializer(Serializer):
    """Persists a :class:`StageRecord` as its cache manifest (the ``meta.json`` marker) and nothing else."""

    type: Literal["ppoflow-step-manifest"] = "ppoflow-step-manifest"

    def dumps(self, obj: Any) -> bytes:
        if not isinstance(obj, StageRecord) or obj.manifest is None:
            # Refusing leaves Prefect's transaction uncommitted: no marker, no record, nothing valid.
            raise ValueError("no cache entry to commit (the payload was not written)")
        return StepCache.encode_manifest(obj.manifest)

    def loads(self, blob: bytes) -> StageRecord:
        manifest = StepCache.decode_manifest(blob)
        return StageRecord(fields=None, metrics=manifest.get("metrics", {}), manifest=manifest)


@dataclass(frozen=True)
class StepDump:
    """Where a stage task body writes its payload, and what else its manifest records."""

    cache: StepCache
    step: int
    meta: dict


def dump_stage(dump: StepDump | None, fields: TensorDict, metrics: dict[str, float],
               meta: dict | None = None) -> StageRecord:
    """The record a stage task returns; with ``dump``, its payload is written first (with retries).

    ``meta`` adds what only the task body knows to the manifest. A write that still fails is
    logged as a warning and reported as the metric ``skip/<stage>/dump_failed``; training goes on
    and no entry reads as valid.
    """
    if dump is None:
        return StageRecord(fields, metrics)
    try:
        manifest = dump.cache.write_payload(dump.step, fields, meta={**dump.meta, **(meta or {}), "metrics": metrics})
    except CacheWriteError as error:
        logger.warning("could not cache %s of step %d: %s", dump.cache.stage, dump.step, error)
        return StageRecord(fields, {**metrics, f"skip/{dump.cache.stage}/dump_failed": 1.0})
    return StageRecord(fields, metrics, manifest)


def fingerprint(batch: TensorDict, **context: Any) -> str:
    """A checksum of the batch's tensor fields (and ``context``): a cached stage result is only
    reused for exactly the input it was computed from."""
    tensors = batch.exclude(*NON_TENSOR_FIELDS)
    return tensors_digest({name: tensors[name] for name in tensors.keys()}, repr(sorted(context.items())))


@dataclass(frozen=True)
class CachePlan:
    """How one stage call of one step uses the cache."""

    stage: str
    step: int
    load_step: int | None  # the entry to replay (``step`` itself or repeat's substitute); None = compute and dump
    key: str  # Prefect cache key: the marker path relative to dump_dir

    @property
    def hit_expected(self) -> bool:
        return self.load_step is not None


def run_cache_dir(skip: SkipStageConfig, cfg: PPOConfig) -> str:
    """The run's cache directory under ``skip.dump_dir`` (verl's layout, from the run's shape)."""
    return config_dir(normalize_url(skip.dump_dir), experiment_name=cfg.trainer.experiment_name,
                      project_name=cfg.trainer.project_name, gbs=cfg.gen_batch_size,
                      n=cfg.actor_rollout_ref.rollout.n, max_prompt_length=cfg.data.max_prompt_length,
                      max_response_length=cfg.data.max_response_length)


def storage_settings(skip: SkipStageConfig) -> dict:
    """fsspec options for ``dump_dir``; s3fs's listings cache off, or another process's keys look missing."""
    options = dict(skip.storage_options)
    if skip.dump_dir.startswith(("s3://", "s3a://")):
        options.setdefault("use_listings_cache", False)
    return options


class StageCache:
    """One stage's step cache for a run: where it lives, which steps it covers, its Prefect storage."""

    def __init__(self, stage: str, skip: SkipStageConfig, cfg: PPOConfig):
        self.stage, self.skip = stage, skip
        dump_dir, root, settings = normalize_url(skip.dump_dir), run_cache_dir(skip, cfg), storage_settings(skip)
        self.prefix = root[len(dump_dir):].strip("/")
        self.cache = StepCache(root, stage=stage, storage_options=settings)
        self.result_storage = _saved_storage_block(dump_dir, settings)
        self.key_storage = DerivedRecords(basepath=dump_dir, settings=settings,
                                          storage_block_id=self.result_storage._block_document_id)

    def covers(self, step: int) -> bool:
        return self.skip.enable and step in self.skip.steps

    def plan(self, step: int) -> CachePlan:
        """verl's rules over valid entries: ``cache`` replays this step, ``repeat`` the nearest one."""
        load_step = self.cache.resolve(step, self.skip.action)
        return self.plan_dump(step) if load_step is None else CachePlan(self.stage, step, load_step, self._key(load_step))

    def plan_dump(self, step: int) -> CachePlan:
        """Compute the stage and dump it at ``step`` (replacing whatever Prefect recorded there)."""
        return CachePlan(self.stage, step, None, self._key(step))

    def _key(self, step: int) -> str:
        return f"{self.prefix}/{step}/{marker_name(self.stage)}"

    def task_options(self, plan: CachePlan) -> dict:
        """``with_options`` arguments that make a stage task a step-keyed, persisted Prefect cache entry."""
        policy = CacheKeyFnPolicy(cache_key_fn=lambda context, parameters: plan.key).configure(
            key_storage=self.key_storage)
        return {"cache_policy": policy, "result_storage": self.result_storage,
                "result_serializer": ManifestSerializer(), "persist_result": True,
                "cache_result_in_memory": False, "refresh_cache": not plan.hit_expected}


class StepCacheStorage(WritableFileSystem):
    """Prefect's result storage for step-cache entries: the ``dump_dir`` (any fsspec URL), where the
    record Prefect persists is the entry's marker, written atomically and with retries like every
    other cache file (Prefect's own file blocks write in place, so a crash could leave half a marker)."""

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
        write_with_retries(url, lambda: atomic_write(fs, url, content), retries=3, backoff_s=0.5,
                           error=CacheWriteError)
        return url

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return self.write_path(path, content)


class DerivedRecords(WritableFileSystem):
    """The cache policy's ``key_storage``: Prefect's record of an entry, derived from its marker.

    Reading the record of a key validates the marker at that key (it must decode as a manifest of
    this step and stage) and returns metadata that names :class:`ManifestSerializer` and the marker
    itself as the result; an invalid or absent marker raises, which Prefect reads as "no record".
    Writing stores nothing: the marker Prefect has just written is the record. So there is no
    Prefect-owned file in the cache to edit, poison or delete.
    """

    _block_type_name = "ppoflow step cache records"

    basepath: str
    settings: dict = Field(default_factory=dict)
    storage_block_id: Optional[uuid.UUID] = None

    def read_path(self, path: str, _sync: bool | None = None) -> bytes:
        config_path, step, stage = parse_marker_key(path)
        StepCache(join(self.basepath, config_path), stage=stage, storage_options=self.settings).manifest(step)
        return ResultRecordMetadata(storage_key=path, expiration=None, serializer=ManifestSerializer(),
                                    storage_block_id=self.storage_block_id).dump_bytes()

    def write_path(self, path: str, content: bytes, _sync: bool | None = None) -> str:
        return path

    async def aread_path(self, path: str) -> bytes:
        return self.read_path(path)

    async def awrite_path(self, path: str, content: bytes) -> str:
        return self.write_path(path, content)


def _saved_storage_block(dump_dir: str, settings: dict) -> StepCacheStorage:
    """The result storage block of ``dump_dir``, saved (Prefect requires it; it also makes Prefect record
    keys relative, so the cache stays valid when the folder is mounted elsewhere); named after it."""
    block = StepCacheStorage(basepath=dump_dir, settings=settings)
    block.save("ppoflow-cache-" + hashlib.sha256(f"{dump_dir}|{sorted(settings.items())}".encode()).hexdigest()[:16],
               overwrite=True)
    return block


def stage_caches(cfg: PPOConfig) -> dict[str, StageCache]:
    """The enabled step caches of a run, keyed by stage."""
    return {stage: StageCache(stage, skip, cfg) for stage, skip in cfg.skip.items() if skip.enable}
