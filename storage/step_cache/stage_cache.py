"""Calling a stage through its step cache: the rules, applied from outside the stage's body.

:meth:`StageCache.plan` picks the entry to replay (``cache``: this step's; ``repeat``: the nearest valid one); the
task is then called with that entry's key and an :class:`~.prefect.EntryCheck` that loads, checksums and matches
it against what the caller ``requires`` before the run is ``Cached`` (a rollout is then fitted onto this step's
prompts); a rejected or missing entry runs the task with ``refresh_cache`` and dumps its result through the
``dump`` parameter :func:`cacheable` gives it. What became of each planned step is kept in
:attr:`StageCache.outcomes` for the run's report. Details: docs/step_cache.md#how-it-works.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

from ppoflow.storage.batch import NON_TENSOR_FIELDS, StageResult, tensors_digest
from ppoflow.storage.bounded import bounded, client_timeouts
from ppoflow.storage.fs import open_fs, remove_stale_temp_files
from ppoflow.storage.step_cache.manifest import marker_name
from ppoflow.storage.step_cache.prefect import CacheEntryRejected, EntryCheck, PrefectStore, StageRecord, rejection
from ppoflow.storage.step_cache.store import StepCache

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepDump:
    """Where a stage writes its result's payload, and what else the entry's manifest records."""

    cache: StepCache
    step: int
    meta: dict
    timeout_s: float

    def write(self, result: StageResult) -> StageRecord:
        """Write ``result``'s payload (with retries, within ``timeout_s``); a write that still fails or
        stalls is a warning and the metric ``skip/<stage>/dump_failed``, and leaves nothing valid:
        training goes on."""
        meta = {**self.meta, "metrics": result.metrics}
        if "weight_version" in result.fields.keys():  # the weights that sampled a rollout
            versions = result.fields["weight_version"]
            meta["weight_version"] = {"min": int(versions.min()), "max": int(versions.max())}
        try:
            manifest = bounded(
                lambda: self.cache.write_payload(self.step, result.fields, meta=meta),
                timeout_s=self.timeout_s,
                what=f"writing {self.cache.payload_url(self.step)}",
            )
        except Exception as error:  # CacheWriteError after its retries, a stall, a client error
            logger.warning("could not cache %s of step %d: %s", self.cache.stage, self.step, error)
            return StageRecord(result.fields, {**result.metrics, f"skip/{self.cache.stage}/dump_failed": 1.0})
        logger.info("wrote the %s of step %d to %s", self.cache.stage, self.step, self.cache.payload_url(self.step))
        return StageRecord(result.fields, result.metrics, manifest)


@dataclass(frozen=True)
class ReplayOnly:
    """The ``dump`` of a replay's task run: it must replay its entry. If Prefect runs the body after all (it
    found no valid record: the marker is damaged, foreign or gone), the body refuses, naming why, instead
    of computing the stage."""

    cache: StepCache
    step: int

    def refusal(self) -> CacheEntryRejected:
        reason = self.cache.status(self.step).reason or "it changed while being read"
        return rejection(
            f"no valid {self.cache.stage} cache entry to replay at {self.cache.step_url(self.step)} ({reason})"
        )


def cacheable(stage: Callable[..., StageResult]) -> Callable[..., StageResult]:
    """Give a stage function an optional keyword ``dump``: given a :class:`StepDump`, the function's result
    is written there before the task returns; given :class:`ReplayOnly`, the function is not called and
    the task run is a rejected replay. The stage's own body never sees it."""
    signature = inspect.signature(stage)

    @functools.wraps(stage)
    def run(*args, dump: StepDump | ReplayOnly | None = None, **kwargs) -> StageResult:
        if isinstance(dump, ReplayOnly):
            raise dump.refusal()
        result = stage(*args, **kwargs)
        return result if dump is None else dump.write(result)

    dump = inspect.Parameter(
        "dump", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="StepDump | ReplayOnly | None"
    )
    run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), dump])
    return run


def fingerprint(batch: TensorDict, **context: Any) -> str:
    """A checksum of the batch's tensor fields (and ``context``): a cached stage result is only
    reused for exactly the input it was computed from."""
    tensors = batch.exclude(*NON_TENSOR_FIELDS)
    return tensors_digest({name: tensors[name] for name in tensors.keys()}, repr(sorted(context.items())))


@dataclass(frozen=True)
class CachePlan:
    """How one stage call of one step uses the cache."""

    step: int
    load_step: int | None  # the entry to replay (``step`` itself or repeat's substitute); None = compute and dump
    key: str  # Prefect cache key: the marker path relative to dump_dir

    @property
    def hit_expected(self) -> bool:
        return self.load_step is not None


OUTCOMES = ("replayed", "rejected", "missing", "unreadable")


@dataclass(frozen=True)
class StepOutcome:
    """What became of one planned step (one of :data:`OUTCOMES`): ``replayed`` (``detail``: the step whose
    entry ``repeat`` replayed, when another), ``rejected`` (``detail``: why; then computed and written),
    ``missing`` (no entry to replay: computed and written), ``unreadable`` (``detail``: the store's error;
    computed without the cache)."""

    step: int
    outcome: str
    detail: str = ""


class StageCache:
    """One stage's step cache in a run: its entries, the steps it covers, its action, its Prefect store.

    ``key`` is the stage's cache key (``skip.<key>``, ``skip/<key>/*`` metrics); ``root`` the run's
    configuration directory under ``dump_dir``. Every storage call is bounded by ``timeout_s`` and a
    failed write is retried ``retries`` times; ``allow_mismatch`` replays entries whose recorded
    requirements differ (logging the differences); an entry larger than ``max_entry_bytes`` (more than a
    step of this run can hold) is refused before it is read. ``outcomes`` records what became of each
    planned step the run reached (its first call: a step's first round).
    """

    def __init__(
        self,
        key: str,
        dump_dir: str,
        root: str,
        *,
        steps: list[int],
        action: str,
        storage_options: dict,
        timeout_s: float,
        retries: int,
        allow_mismatch: bool,
        max_entry_bytes: int,
    ):
        self.key, self.steps, self.action = key, frozenset(steps), action
        self.timeout_s, self.allow_mismatch, self.max_entry_bytes = timeout_s, allow_mismatch, max_entry_bytes
        options = client_timeouts(dump_dir, storage_options, timeout_s=timeout_s, retries=retries)
        self.entries = StepCache(root, stage=key, storage_options=options, write_retries=retries)
        remove_stale_temp_files(*open_fs(self.entries.root, options))  # left by writes a crash interrupted
        self.dump_dir, self.storage_options = dump_dir, options
        self.prefix = self.entries.root[len(dump_dir) :].strip("/")
        self.store = PrefectStore(dump_dir, options)
        self.outcomes: dict[int, StepOutcome] = {}

    def covers(self, step: int) -> bool:
        return step in self.steps

    def plan(self, step: int) -> CachePlan:
        """verl's rules: ``cache`` replays this step's committed entry (one with a marker, valid or not: the
        replay judges it, so a damaged entry is a rejected replay, not a silent recomputation), ``repeat``
        the nearest valid one."""
        if self.action == "cache":
            load_step = step if self.entries.has_marker(step) else None
        else:
            load_step = self.entries.resolve(step, self.action)
        return self.plan_dump(step) if load_step is None else CachePlan(step, load_step, self.record_key(load_step))

    def plan_dump(self, step: int) -> CachePlan:
        """Compute the stage and dump it at ``step`` (replacing whatever entry was there)."""
        return CachePlan(step, None, self.record_key(step))

    def record_key(self, step: int) -> str:
        return f"{self.prefix}/{step}/{marker_name(self.key)}"

    def task_options(self, plan: CachePlan, check: EntryCheck | None = None) -> dict:
        """A replay's task options (with its ``check``) or a dump's."""
        return self.store.task_options(plan.key, check=check)

    def check(self, plan: CachePlan, requires: dict, identity: dict) -> EntryCheck:
        """What the planned entry must pass to be replayed (see :class:`~.prefect.EntryCheck`)."""
        return EntryCheck(
            root=self.entries.root,
            stage=self.key,
            step=plan.load_step,
            settings=self.storage_options,
            requires=requires,
            identity=identity,
            allow_mismatch=self.allow_mismatch,
            max_bytes=self.max_entry_bytes,
        )

    def note(self, step: int, outcome: str, detail: str = "") -> None:
        """Record what became of planned ``step`` (its first call only)."""
        self.outcomes.setdefault(step, StepOutcome(step, outcome, detail))


class PendingStage:
    """A started stage call. ``result()`` runs it (when not started in the background) or waits for it,
    once; ``background_seconds`` is, for a call started in the background, how long it ran
    (submission to completion): what one-step-off overlaps with training."""

    def __init__(self, finish: Callable[[], StageResult]):
        self._finish = finish
        self._result: StageResult | None = None
        self.background_seconds: float | None = None

    def result(self) -> StageResult:
        if self._result is None:
            self._result = self._finish()
        return self._result

    @classmethod
    def done(cls, result: StageResult) -> PendingStage:
        """A call whose result is already there (a batch restored from a checkpoint)."""
        pending = cls(lambda: result)
        pending.result()
        return pending


def start_stage(
    cache: StageCache | None,
    task,
    step: int,
    *args,
    meta: dict | None = None,
    requires: dict | None = None,
    identity: dict | None = None,
    fit: Callable[[TensorDict], TensorDict] | None = None,
    background: bool = False,
    **kwargs,
) -> PendingStage:
    """Start ``task(*args, **kwargs)`` for ``step``, replaying or dumping its result as ``cache`` says.

    ``background`` submits the task as a Prefect future (one-step-off generation); a replay is never
    started in the background: it is resolved when awaited and starts no generation. ``meta``,
    ``requires`` and ``identity`` go into a dumped entry's manifest. A replayed entry must have recorded
    ``requires`` exactly (the input it was computed from), and ``identity`` too (how it was sampled)
    unless the cache allows a mismatch; ``fit`` adapts a replayed entry's fields to this step. A rejected
    entry is the metric ``skip/<key>/rejected``; the step is then computed and dumped.
    """
    if cache is None or not cache.covers(step):
        return _launch(task, args, kwargs, background, lambda result: result)
    requires, identity = (json.loads(json.dumps(values or {})) for values in (requires, identity))  # as recorded
    meta = {**(meta or {}), **requires, **identity}
    miss = {f"skip/{cache.key}/hit": 0.0}

    def compute(background: bool, *, plan: CachePlan | None, metrics: dict | None = None) -> PendingStage:
        """Run the task; with a ``plan``, dump its result at this step, else (storage failing) don't."""
        extra = {**miss, **(metrics or {})}
        if plan is None:
            extra[f"skip/{cache.key}/read_failed"] = 1.0
            return _launch(
                task, args, kwargs, background, lambda result: StageResult(result.fields, {**result.metrics, **extra})
            )
        return _launch(
            task.with_options(**cache.task_options(plan)),
            args,
            {**kwargs, "dump": StepDump(cache.entries, step, meta, cache.timeout_s)},
            background,
            lambda record: StageResult(record.fields, {**record.metrics, **extra}),
        )

    def unreadable(error: Exception, what: str, background: bool = False) -> PendingStage:
        """The store failed: compute without it (``skip/<key>/read_failed``)."""
        logger.warning("%s (%r); computing step %d without the cache", what, error, step)
        cache.note(step, "unreadable", repr(error))
        return compute(background, plan=None)

    try:
        plan = bounded(
            lambda: cache.plan(step), timeout_s=cache.timeout_s, what=f"looking up step {step} in {cache.entries.root}"
        )
    except Exception as error:  # the store is unreachable, stalls or answers garbage: go on without it
        return unreadable(error, f"the {cache.key} cache cannot be read", background)
    if not plan.hit_expected:
        cache.note(step, "missing")
        return compute(background, plan=plan)

    def replay() -> StageResult:
        check = cache.check(plan, requires, identity)
        try:
            record = bounded(
                lambda: _replay(cache, task, plan, check, args, kwargs),
                timeout_s=cache.timeout_s,
                what=f"loading step {plan.load_step} from {cache.entries.root}",
            )
        except CacheEntryRejected as rejected:  # its task run says why; the step is computed and dumped
            cache.note(step, "rejected", rejected.reason)
            return compute(False, plan=cache.plan_dump(step), metrics={f"skip/{cache.key}/rejected": 1.0}).result()
        except Exception as error:
            return unreadable(error, f"the cached {cache.key} of step {plan.load_step} cannot be read").result()
        cache.note(step, "replayed", "" if plan.load_step == step else f"the entry of step {plan.load_step}")
        return StageResult(
            fit(record.fields) if fit else record.fields,
            {**record.metrics, f"skip/{cache.key}/hit": 1.0, f"skip/{cache.key}/load_step": float(plan.load_step)},
        )

    return PendingStage(replay)


def _launch(task, args, kwargs, background: bool, finish: Callable[[StageResult], StageResult]) -> PendingStage:
    """Call the task when awaited, or submit it now (a Prefect future in the flow's task runner)."""
    if not background:
        return PendingStage(lambda: finish(task(*args, **kwargs)))
    submitted = time.perf_counter()
    finished: list[float] = []
    future = task.submit(*args, **kwargs)
    future.add_done_callback(lambda _: finished.append(time.perf_counter()))

    def wait() -> StageResult:
        result = finish(future.result())
        pending.background_seconds = (finished[0] if finished else time.perf_counter()) - submitted
        return result

    pending = PendingStage(wait)
    return pending


def _replay(cache: StageCache, task, plan: CachePlan, check: EntryCheck, args, kwargs) -> StageRecord:
    """The planned entry, loaded and checked as Prefect reads its record (a ``Cached`` run), or
    :class:`CacheEntryRejected` (a ``Failed`` run whose logs say why).

    Prefect's record of the entry is derived from its marker, so an entry written by another process or
    tool is ``Cached`` too. The body is given :class:`ReplayOnly`, so a body Prefect runs after all (no
    valid record) refuses instead of computing, and can never overwrite the entry being replayed.
    """
    return task.with_options(**cache.task_options(plan, check))(
        *args, **kwargs, dump=ReplayOnly(cache.entries, plan.load_step)
    )
