"""Calling a stage task through its step cache: the rules, applied from outside the stage's body.

:func:`start_stage` plans the call (:mod:`.planning`); a replay calls the task with the entry's key and an
:class:`~ppoflow.storage.step_cache.entry_check.EntryCheck` that loads, checksums and matches the entry against what
the caller ``requires`` before the run is ``Cached`` (a rollout is then fitted onto this step's prompts); a rejected
or missing entry runs the task with ``refresh_cache`` and writes its result through the ``dump`` keyword
:func:`dumping` gives the task. Details: docs/step_cache.md#how-it-works.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

from ppoflow.flows.cached_stages.planning import CachePlan, StageCache
from ppoflow.storage.batch import StageResult
from ppoflow.storage.bounded import bounded
from ppoflow.storage.step_cache.entry_check import CacheEntryRejected, EntryCheck, StageRecord, rejection
from ppoflow.storage.step_cache.store import StepCache
from ppoflow.tasks.task_inputs import RecordedTask

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


def dumping(task: RecordedTask) -> RecordedTask:
    """``task`` with a keyword ``dump`` its function does not have: given a :class:`StepDump`, the stage's
    result is written there before the task run returns (so Prefect commits the entry's marker after its
    payload); given :class:`ReplayOnly`, the stage is not computed and the task run is a rejected replay. The
    stage's own body never sees it, and the task keeps its name, options and Prefect task key."""
    stage = task.fn
    signature = inspect.signature(stage)

    @functools.wraps(stage)
    def run(*args, dump: StepDump | ReplayOnly, **kwargs) -> StageResult:
        if isinstance(dump, ReplayOnly):
            raise dump.refusal()
        return dump.write(stage(*args, **kwargs))

    keyword = inspect.Parameter("dump", inspect.Parameter.KEYWORD_ONLY, annotation="StepDump | ReplayOnly")
    run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), keyword])
    wrapped = copy.copy(task)
    wrapped.fn = run
    return wrapped


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
    task: RecordedTask,
    step: int,
    arguments: dict[str, Any],
    *,
    meta: dict | None = None,
    requires: dict | None = None,
    identity: dict | None = None,
    fit: Callable[[TensorDict], TensorDict] | None = None,
    background: bool = False,
) -> PendingStage:
    """Start ``task(**arguments)`` for ``step``, replaying or dumping its result as ``cache`` says.

    ``background`` submits the task as a Prefect future (one-step-off generation); a replay is never
    started in the background: it is resolved when awaited and starts no generation. ``meta``,
    ``requires`` and ``identity`` go into a dumped entry's manifest. A replayed entry must have recorded
    ``requires`` exactly (the input it was computed from), and ``identity`` too (how it was sampled)
    unless the cache allows a mismatch; ``fit`` adapts a replayed entry's fields to this step. A rejected
    entry is the metric ``skip/<key>/rejected``; the step is then computed and dumped.
    """
    if cache is None or not cache.covers(step):
        return _launch(task, arguments, background, lambda result: result)
    requires, identity = (json.loads(json.dumps(values or {})) for values in (requires, identity))  # as recorded
    meta = {**(meta or {}), **requires, **identity}
    miss = {f"skip/{cache.key}/hit": 0.0}

    def compute(background: bool, *, plan: CachePlan | None, metrics: dict | None = None) -> PendingStage:
        """Run the task; with a ``plan``, dump its result at this step, else (storage failing) don't."""
        extra = {**miss, **(metrics or {})}
        if plan is None:
            extra[f"skip/{cache.key}/read_failed"] = 1.0
            return _launch(
                task, arguments, background, lambda result: StageResult(result.fields, {**result.metrics, **extra})
            )
        return _launch(
            dumping(task).with_options(**cache.task_options(plan)),
            {**arguments, "dump": StepDump(cache.entries, step, meta, cache.timeout_s)},
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
                lambda: _replay(cache, task, plan, check, arguments),
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


def _launch(task, arguments: dict, background: bool, finish: Callable[[StageResult], StageResult]) -> PendingStage:
    """Call the task when awaited, or submit it now (a Prefect future in the flow's task runner)."""
    if not background:
        return PendingStage(lambda: finish(task(**arguments)))
    submitted = time.perf_counter()
    finished: list[float] = []
    future = task.submit(**arguments)
    future.add_done_callback(lambda _: finished.append(time.perf_counter()))

    def wait() -> StageResult:
        result = finish(future.result())
        pending.background_seconds = (finished[0] if finished else time.perf_counter()) - submitted
        return result

    pending = PendingStage(wait)
    return pending


def _replay(cache: StageCache, task: RecordedTask, plan: CachePlan, check: EntryCheck, arguments: dict) -> StageRecord:
    """The planned entry, loaded and checked as Prefect reads its record (a ``Cached`` run), or
    :class:`CacheEntryRejected` (a ``Failed`` run whose logs say why).

    Prefect's record of the entry is derived from its marker, so an entry written by another process or
    tool is ``Cached`` too. The body is given :class:`ReplayOnly`, so a body Prefect runs after all (no
    valid record) refuses instead of computing, and can never overwrite the entry being replayed.
    """
    replaying = dumping(task).with_options(**cache.task_options(plan, check))
    return replaying(**arguments, dump=ReplayOnly(cache.entries, plan.load_step))
