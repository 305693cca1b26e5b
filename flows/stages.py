"""Calling one stage task of a step, through the stage's step cache when ``skip.<stage>`` covers it.

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
from dataclasses import dataclass

from tensordict import TensorDict

from storage.rollout_cache import ROLLOUT_STAGE, CacheCorrupt, remap_to_prompts
from tasks.caching import CachePlan, StageCache, StageRecord, StepDump

logger = logging.getLogger(__name__)


@dataclass
class StageResult:
    """A stage's new batch fields and its metrics, including how the cache served it (``skip/<stage>/*``)."""

    fields: TensorDict
    metrics: dict[str, float]


def call_stage(cache: StageCache | None, task, step: int, *args, fingerprint: str | None = None,
               meta: dict | None = None, prompt_uids: list[str] | None = None, n: int = 1, **kwargs) -> StageResult:
    """Run ``task(*args, **kwargs)`` for ``step``, replaying or dumping its result as configured.

    ``fingerprint`` identifies the stage's input (non-rollout stages); ``meta`` goes into the
    manifest; ``prompt_uids`` and ``n`` fit a replayed rollout onto this step's prompts.
    """
    if cache is None or not cache.covers(step):
        record = task(*args, **kwargs)
        return StageResult(record.fields, record.metrics)
    meta = {**(meta or {}), **({"input_fingerprint": fingerprint} if fingerprint else {})}
    plan = cache.plan(step)
    if plan.hit_expected:
        replayed = _replay(cache, task, plan, args, kwargs)
        if isinstance(replayed, StageRecord):  # Prefect ran the body after all: a fresh, undumped result
            return StageResult(replayed.fields, {**replayed.metrics, f"skip/{cache.stage}/hit": 0.0})
        if replayed is not None and _fits(cache.stage, replayed[1], fingerprint):
            fields, manifest = replayed
            if cache.stage == ROLLOUT_STAGE:
                fields = remap_to_prompts(fields, prompt_uids, n)
            return StageResult(fields, {**manifest.get("metrics", {}), f"skip/{cache.stage}/hit": 1.0,
                                        f"skip/{cache.stage}/load_step": float(plan.load_step)})
        plan = cache.plan_dump(step)
    record = task.with_options(**cache.task_options(plan))(*args, dump=StepDump(cache.cache, step, meta), **kwargs)
    return StageResult(record.fields, {**record.metrics, f"skip/{cache.stage}/hit": 0.0})


def _replay(cache: StageCache, task, plan: CachePlan, args, kwargs) -> tuple[TensorDict, dict] | StageRecord | None:
    """The planned entry's fields and manifest, read through the cached task (a ``Cached`` run).

    The task is called without a dump target, so even if Prefect ran its body it could not
    overwrite the entry being replayed. None when the entry is damaged (with a warning).
    """
    try:
        cache.adopt(plan)
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
