"""Starting one stage task of a step, through the stage's step cache when ``skip.<stage>`` covers it.

The rules (verl's, plus the safety verl lacks) in the order they apply:

1. a step outside ``skip.<stage>.steps`` (or caching off) just runs the task;
2. otherwise :meth:`tasks.caching.StageCache.plan` picks the entry to replay among *valid*
   entries (``cache``: this step's; ``repeat``: this step's, else the nearest below, else above);
3. with an entry, the task is called with that entry's key and shows as ``Cached``; its tensors are
   then loaded and checksummed. A rollout is fitted onto this step's prompts (verl's V1 uid remap);
   any other stage must have been computed from exactly this input (its fingerprint), or it is
   recomputed;
4. without one, or when loading fails, the task runs with ``refresh_cache`` and dumps its result
   at this step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tensordict import TensorDict

from ppoflow.storage.rollout_cache import ROLLOUT_STAGE, CacheCorrupt, remap_to_prompts
from ppoflow.tasks.caching import CachePlan, StageCache, StageRecord, StepDump

logger = logging.getLogger(__name__)


@dataclass
class StageResult:
    """A stage's new batch fields and its metrics, including how the cache served it (``skip/<stage>/*``).

    ``background_seconds``: for a call started in the background, how long it ran (submission to
    completion), which is what one-step-off overlaps with training.
    """

    fields: TensorDict
    metrics: dict[str, float]
    background_seconds: float | None = None


class PendingStage:
    """A started stage call: ``result()`` runs it (when not started in the background) or waits for it."""

    def __init__(self, finish: Callable[[], StageResult]):
        self._finish = finish

    def result(self) -> StageResult:
        return self._finish()


def start_stage(cache: StageCache | None, task, step: int, *args, fingerprint: str | None = None,
                meta: dict | None = None, prompt_uids: list[str] | None = None, n: int = 1,
                background: bool = False, **kwargs) -> PendingStage:
    """Start ``task(*args, **kwargs)`` for ``step``, replaying or dumping its result as configured.

    ``background`` submits the task as a Prefect future (one-step-off generation); a replay is never
    started in the background: it is resolved when awaited and starts no generation. ``fingerprint``
    identifies a non-rollout stage's input; ``meta`` goes into the manifest; ``prompt_uids`` and
    ``n`` fit a replayed rollout onto this step's prompts.
    """
    if cache is None or not cache.covers(step):
        return _launch(task, args, kwargs, background, lambda record: StageResult(record.fields, record.metrics))
    meta = {**(meta or {}), **({"input_fingerprint": fingerprint} if fingerprint else {})}
    miss = {f"skip/{cache.stage}/hit": 0.0}

    def compute_and_dump(plan: CachePlan, background: bool) -> PendingStage:
        return _launch(task.with_options(**cache.task_options(plan)), args,
                       {**kwargs, "dump": StepDump(cache.cache, step, meta)}, background,
                       lambda record: StageResult(record.fields, {**record.metrics, **miss}))

    plan = cache.plan(step)
    if not plan.hit_expected:
        return compute_and_dump(plan, background)

    def replay() -> StageResult:
        replayed = _replay(cache, task, plan, args, kwargs)
        if isinstance(replayed, StageRecord):  # Prefect ran the body after all: a fresh, undumped result
            return StageResult(replayed.fields, {**replayed.metrics, **miss})
        if replayed is not None and _fits(cache.stage, replayed[1], fingerprint):
            fields, manifest = replayed
            if cache.stage == ROLLOUT_STAGE:
                fields = remap_to_prompts(fields, prompt_uids, n)
            return StageResult(fields, {**manifest.get("metrics", {}), f"skip/{cache.stage}/hit": 1.0,
                                        f"skip/{cache.stage}/load_step": float(plan.load_step)})
        return compute_and_dump(cache.plan_dump(step), background=False).result()

    return PendingStage(replay)


def _launch(task, args, kwargs, background: bool, finish: Callable[[StageRecord], StageResult]) -> PendingStage:
    """Call the task when awaited, or submit it now (a Prefect future in the flow's task runner)."""
    if not background:
        return PendingStage(lambda: finish(task(*args, **kwargs)))
    submitted = time.perf_counter()
    finished: list[float] = []
    future = task.submit(*args, **kwargs)
    future.add_done_callback(lambda _: finished.append(time.perf_counter()))

    def wait() -> StageResult:
        result = finish(future.result())
        result.background_seconds = (finished[0] if finished else time.perf_counter()) - submitted
        return result

    return PendingStage(wait)


def _replay(cache: StageCache, task, plan: CachePlan, args, kwargs) -> tuple[TensorDict, dict] | StageRecord | None:
    """The planned entry's fields and manifest, read through the cached task (a ``Cached`` run).

    Prefect's record of the entry is derived from its marker, so an entry written by another process
    or tool is ``Cached`` too. The task is called without a dump target, so even if Prefect ran its body
    (the entry vanished since it was planned) it could not overwrite the entry being replayed. None
    when the entry is damaged (with a warning).
    """
    try:
        record: StageRecord = task.with_options(**cache.task_options(plan))(*args, **kwargs)
        if record.fields is not None:
            return record
        return cache.cache.load(record.manifest["global_steps"])
    except CacheCorrupt as error:
        logger.warning("cached %s of step %d is damaged (%s); recomputing", cache.stage, plan.load_step, error)
        return None


def _fits(stage: str, manifest: dict, fingerprint: str | None) -> bool:
    """A non-rollout entry is reused only for the input it was computed from."""
    if stage == ROLLOUT_STAGE or manifest.get("input_fingerprint") == fingerprint:
        return True
    logger.warning("cached %s of step %s was computed from a different input; recomputing",
                   stage, manifest.get("global_steps"))
    return False
