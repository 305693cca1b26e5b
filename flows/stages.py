"""Calling the declared stages of a step: through their step cache, timed under verl's names, their
fields merged into the step's batch and their metrics into the step's metrics.

A training step is a :class:`StepData`: its number, its batch (from generation on), its metrics. A stage
call is one line in the loop (``stages.call("reward", step, ...)``); everything around the stage's own
work - the cache's replay or dump, the fingerprint a replayed result must match, the timing - happens
here, the same way for every stage.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prefect.utilities.engine import get_state_for_result, link_state_to_task_run_result
from tensordict import TensorDict

from ppoflow.storage.batch import StageResult
from ppoflow.storage.step_cache.stage_cache import PendingStage, StageCache, fingerprint, start_stage
from ppoflow.tasks.stages import STAGES
from ppoflow.workers.group import Workers


@dataclass
class StepData:
    """One training step as the loop builds it: the batch (set by generation, extended by every stage)
    and the step's metrics (``timing_s/*`` included)."""

    step: int
    batch: TensorDict | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    round: int = 0
    """Which of the step's sample-and-update rounds this is (separate_async runs ``parameter_sync_step``)."""

    @property
    def label(self) -> str:
        """What its task runs are named for: ``step=3`` for the step's first round, ``step=3/<round>`` for
        its later ones (separate_async), so that every round's task runs have names of their own."""
        return f"step={self.step}" if self.round == 0 else f"step={self.step}/{self.round}"

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the wall time of the block to ``timing_s/<name>``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - start)

    def add_time(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to ``timing_s/<name>``."""
        key = f"timing_s/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + seconds

    def merge(self, result: StageResult) -> StageResult:
        """Take a stage's new fields into the batch and its metrics into the step's metrics; the batch now
        comes from the stage's task run (:func:`derived_from`)."""
        if result.fields is not None:
            if self.batch is None:
                self.batch = result.fields
            else:
                self.batch.update(result.fields)
                derived_from(result.fields, self.batch)
        self.metrics.update(result.metrics)
        return result


def derived_from(source, derived) -> None:
    """Tell Prefect that ``derived`` comes from the task run that returned ``source``, so a task run it
    is passed to records that one as its input: the Task inputs tab and the run graph's edges then
    chain a step's stages (generate -> reward -> advantage -> update) instead of all pointing back to
    generation. Prefect links only objects a task returned, and the step's batch is one object that
    every stage extends. Nothing happens outside a flow run or when ``source`` came from no task run."""
    produced = get_state_for_result(source)
    if produced is not None:
        link_state_to_task_run_result(produced[0], derived)


class Stages:
    """The run's stages, called as Prefect task runs (``orchestrated``) or as plain functions (the
    overhead benchmark's baseline), each through its step cache when ``skip.<stage>`` enables one.

    Every task run is named for its stage and what it ran for - ``generate[step=12]``,
    ``update_actor[step=12/2]`` (a later round, :attr:`StepData.label`), ``generate[val@20]``,
    ``weight_sync[version=3]`` - so that the Prefect UI's search finds a stage, a
    step or the validation runs. With ``tags`` (``trainer.task_run_tags``: the run's ``mode:<trainer
    mode>``, ``experiment:<name>``) each is also tagged ``stage:<name>`` and ``kind:train`` or
    ``kind:validation`` for the UI's tag filters; without, no tags, because Prefect acquires tag
    concurrency slots from its server before every tagged task run."""

    def __init__(
        self,
        workers: Workers,
        caches: dict[str, StageCache],
        *,
        orchestrated: bool,
        tags: tuple[str, ...] | None = None,
    ):
        self.workers, self.caches, self.orchestrated, self.tags = workers, caches, orchestrated, tags

    def task(self, name: str, label: str, kind: str = "train"):
        """The stage's Prefect task, named ``<name>[<label>]`` and tagged; its plain function when not
        orchestrated."""
        task = STAGES[name].task
        if not self.orchestrated:
            return task.fn
        tags = None if self.tags is None else {f"stage:{name}", f"kind:{kind}", *self.tags}
        return task.named(f"{name}[{label}]", tags)

    def call(self, name: str, step: StepData, *args, **kwargs) -> StageResult:
        """Run stage ``name`` for ``step`` and merge its result; timed as ``timing_s/<its timing name>``."""
        with step.timed(STAGES[name].names.timing):
            result = self._start(name, step, args, kwargs, background=False).result()
        return step.merge(result)

    def call_together(self, step: StepData, calls: dict[str, tuple]) -> None:
        """Run independent stages of ``step`` - ``{name: args}``, none reading another's result (the step's
        forward passes on the actor, reference and critic workers) - side by side: each is its own task run,
        all are submitted before any is awaited, so their workers compute at the same time. Results are
        merged in the order given, each timed from its submission to its end. Plain functions (not
        orchestrated) run one after the other."""
        if not self.orchestrated or len(calls) < 2:
            for name, args in calls.items():
                self.call(name, step, *args)
            return
        started = {name: self._start(name, step, args, {}, background=True) for name, args in calls.items()}
        for name, pending in started.items():
            waited = time.perf_counter()
            result = pending.result()
            seconds = pending.background_seconds  # None: a replayed result, loaded just now when awaited
            step.add_time(STAGES[name].names.timing, seconds if seconds is not None else time.perf_counter() - waited)
            step.merge(result)

    def _start(self, name: str, step: StepData, args: tuple, kwargs: dict, *, background: bool) -> PendingStage:
        """Start stage ``name`` for ``step`` through its cache; a cached forward pass or later stage is
        reused only for this exact batch (and a forward pass's exact weights)."""
        stage, requires = STAGES[name], None
        cache = self.caches.get(name)
        if cache is not None and cache.covers(step.step):
            role = getattr(self.workers, stage.weights) if stage.weights else None
            weights = self.workers.get(role.submit("weights_digest")) if role else None
            requires = {"input_fingerprint": fingerprint(step.batch, weights=weights)}
        return start_stage(
            cache, self.task(name, step.label), step.step, *args, requires=requires, background=background, **kwargs
        )

    def start(self, name: str, step: int, *args, **options) -> PendingStage:
        """Start stage ``name`` for step ``step`` through its cache without waiting (``options`` as
        :func:`~ppoflow.storage.step_cache.start_stage` takes them: ``background``, ``requires``, ...)."""
        return start_stage(self.caches.get(name), self.task(name, f"step={step}"), step, *args, **options)

    def run(self, name: str, *args, label: str, kind: str = "train", **kwargs) -> StageResult:
        """Run stage ``name`` outside any step and its cache (validation, weight pushes), named for ``label``."""
        return self.task(name, label, kind)(*args, **kwargs)
