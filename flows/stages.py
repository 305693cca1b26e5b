"""Calling the stages of a step, by name and with their real arguments: ``stages.reward(step, batch=...)``.

A training step is a :class:`StepData`: its number, its batch (from generation on), its metrics. Each method of
:class:`Stages` runs one stage declared in :mod:`ppoflow.tasks.stages` as a Prefect task run, through its step cache
when ``skip.<key>`` enables one (:mod:`ppoflow.flows.cached_stages`), timed as ``timing_s/<its timing name>``, its
fields merged into the step's batch and its metrics into the step's metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from prefect.utilities.engine import get_state_for_result, link_state_to_task_run_result
from tensordict import TensorDict

from ppoflow.algorithms.scoring import Scorer
from ppoflow.configs.schema import AlgorithmConfig, PPOConfig
from ppoflow.flows.cached_stages.calls import PendingStage, start_stage
from ppoflow.flows.cached_stages.planning import StageCache
from ppoflow.storage.batch import StageResult, non_tensor_column
from ppoflow.storage.fingerprints import batch_fingerprint, model_identities, rollout_identity
from ppoflow.storage.step_cache import remap_to_prompts
from ppoflow.tasks.stages import (
    ADVANTAGE,
    GENERATE,
    OLD_LOG_PROB,
    REF_LOG_PROB,
    REWARD,
    REWARD_MODEL,
    SAMPLE,
    UPDATE_ACTOR,
    UPDATE_CRITIC,
    VALUES,
    WEIGHT_SYNC,
    Stage,
)
from ppoflow.workers.roles import Workers
from ppoflow.workers.rollout.sampling import SamplingParams


@dataclass
class StepData:
    """One training step as the loop builds it: the batch (set by generation, extended by every stage)
    and the step's metrics (``timing_s/*`` included)."""

    step: int
    batch: TensorDict | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    round: int = 0
    """Which of the step's sample-and-update rounds this is (a mode may run several per step)."""
    old_policy: Literal["current", "step_start"] = "current"
    """π_old, the weights stage 3's ``old_log_prob`` uses, as the trainer mode puts it on the step: the actor's
    current ones, or those the step started with (decoupled PPO: one π_old for every round of a step)."""

    @property
    def label(self) -> str:
        """What its task runs are named for: ``step=3`` for the step's first round, ``step=3/<round>`` for
        its later ones, so that every round's task runs have names of their own."""
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


def task_run_of(result) -> str | None:
    """The id of the task run that returned ``result`` (None outside a flow run, or for a plain call)."""
    produced = get_state_for_result(result)
    return None if produced is None else str(produced[0].state_details.task_run_id)


@dataclass(frozen=True)
class RolloutOrigin:
    """How the run samples: what a cached rollout must have been sampled with to be replayed here (its
    :attr:`identity`, hashed from the model files on first use) and what a written one records beside it."""

    model_path: str
    tokenizer_path: str
    dtype: str
    sampling: SamplingParams

    @classmethod
    def of(cls, cfg: PPOConfig, sampling: SamplingParams) -> RolloutOrigin:
        model = cfg.actor_rollout_ref.model
        return cls(model.path, model.tokenizer_path or model.path, cfg.actor_rollout_ref.rollout.dtype, sampling)

    @cached_property
    def identity(self) -> dict:
        """See :func:`~ppoflow.storage.fingerprints.rollout_identity`."""
        models = model_identities(self.model_path, self.tokenizer_path, self.dtype)
        return rollout_identity(self.sampling.as_dict(), models)

    def record(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "seed": self.sampling.seed}


@dataclass(frozen=True)
class StageCall:
    """A stage call of a step not started yet: the stage and the task's arguments."""

    stage: Stage
    arguments: dict[str, Any]


class Stages:
    """The run's stages, called as Prefect task runs (``orchestrated``) or as plain functions (the
    overhead benchmark's baseline), each through its step cache when ``skip.<stage>`` enables one.

    Every task run is named for its stage and what it ran for - ``generate[step=12]``,
    ``update_actor[step=12/2]`` (a later round, :attr:`StepData.label`), ``generate[val@20]``,
    ``weight_sync[version=3]`` - so that the Prefect UI's search finds a stage, a step or the validation runs.
    With ``tags`` (``trainer.task_run_tags``) each is also tagged ``stage:<name>`` and ``kind:train`` or
    ``kind:validation``; without, no tags, because Prefect acquires tag concurrency slots from its server
    before every tagged task run."""

    def __init__(
        self,
        workers: Workers,
        caches: dict[str, StageCache],
        *,
        orchestrated: bool,
        rollout: RolloutOrigin,
        tags: tuple[str, ...] | None = None,
    ):
        self.workers, self.caches, self.orchestrated = workers, caches, orchestrated
        self.rollout, self.tags = rollout, tags

    # -- 1. generate (the streaming modes: sample) ----------------------------------------------------------

    def generate(self, step: int, *, prompts: TensorDict, background: bool = False) -> PendingStage:
        """Start sampling ``rollout.n`` responses per prompt of ``step``'s batch, not awaited; with ``background``
        as a Prefect future that runs while the caller goes on. A replayed rollout is fitted onto ``prompts``."""
        uids, n = non_tensor_column(prompts, "uid"), self.rollout.sampling.n
        return self._start(
            GENERATE,
            step,
            {"workers": self.workers, "prompts": prompts, "step": step, "sampling": self.rollout.sampling},
            label=f"step={step}",
            background=background,
            fit=lambda entry: remap_to_prompts(entry, uids, n),
        )

    def sample(
        self, step: StepData, *, buffer, batch_size: int, poll: Callable[[float], None], in_order: bool
    ) -> StageResult:
        """The step's batch from the replay buffer (the streaming modes), not merged: the mode adds the prompts'
        columns first."""
        arguments = {"buffer": buffer, "step": step.step, "batch_size": batch_size, "poll": poll, "in_order": in_order}
        return self._task(SAMPLE, step.label)(**arguments)

    # -- 2. reward -----------------------------------------------------------------------------------------

    def reward_model(self, step: StepData, *, batch: TensorDict, tokenizer, model_reward) -> StageResult:
        """``rm_scores`` of each response from the reward model or the reward service (``model_reward``)."""
        arguments = {"batch": batch, "tokenizer": tokenizer, "model_reward": model_reward}
        return self._call(step, StageCall(REWARD_MODEL, arguments))

    def reward(
        self,
        step: StepData,
        *,
        batch: TensorDict,
        tokenizer,
        scorer: Scorer | None,
        ray_chunks: int,
        keep_extras: bool = False,
        combine: str = "sum",
    ) -> StageResult:
        """``token_level_scores`` of each response (``ray_chunks`` > 0: scored in that many Prefect tasks on Ray;
        ``keep_extras``: each response's extras too, for dynamic sampling's ``acc``; ``combine``: how rule scores
        meet the ``rm_scores`` of a batch the reward_model stage scored)."""
        arguments = {"batch": batch, "tokenizer": tokenizer, "custom_scorer": scorer, "ray_chunks": ray_chunks}
        if keep_extras:
            arguments["keep_extras"] = True
        if "rm_scores" in batch.keys():
            arguments["combine"] = combine
        return self._call(step, StageCall(REWARD, arguments))

    # -- 3. the forward passes -----------------------------------------------------------------------------

    def forward_passes(
        self, step: StepData, batch_ref, *, old_log_prob: bool, ref_log_prob: bool, values: bool
    ) -> None:
        """The step's independent forward passes on the actor (π_old: :attr:`StepData.old_policy`), the reference
        and the critic, those asked for: submitted together, so their workers compute at the same time."""
        calls = []
        if old_log_prob:
            at_step_start = step.old_policy == "step_start"
            arguments = {"workers": self.workers, "batch_ref": batch_ref, "at_step_start": at_step_start}
            calls.append(StageCall(OLD_LOG_PROB, arguments))
        if ref_log_prob:
            calls.append(StageCall(REF_LOG_PROB, {"workers": self.workers, "batch_ref": batch_ref}))
        if values:
            calls.append(StageCall(VALUES, {"workers": self.workers, "batch_ref": batch_ref}))
        self.together(step, calls)

    # -- 4. advantage --------------------------------------------------------------------------------------

    def advantage(self, step: StepData, *, batch: TensorDict, algorithm: AlgorithmConfig, kl_controller) -> StageResult:
        """``token_level_rewards``, ``advantages`` and ``returns``; moves the adaptive KL controller."""
        arguments = {"batch": batch, "algorithm": algorithm, "kl_controller": kl_controller}
        return self._call(step, StageCall(ADVANTAGE, arguments))

    # -- 5. the updates ------------------------------------------------------------------------------------

    def update_critic(self, step: StepData, *, batch_ref) -> StageResult:
        arguments = {"workers": self.workers, "batch_ref": batch_ref, "step": step.step}
        return self._call(step, StageCall(UPDATE_CRITIC, arguments))

    def update_actor(self, step: StepData, *, batch_ref) -> StageResult:
        arguments = {"workers": self.workers, "batch_ref": batch_ref, "step": step.step}
        return self._call(step, StageCall(UPDATE_ACTOR, arguments))

    # -- 6. weight_sync ------------------------------------------------------------------------------------

    def weight_sync(self, *, version: int, collective: bool, again: bool = False) -> StageResult:
        """The rollout takes the actor's current weights, stamped ``version`` (``again``: those pushed last)."""
        arguments = {"workers": self.workers, "collective": collective, "again": again, "version": version}
        return self._task(WEIGHT_SYNC, f"version={version}")(**arguments)

    # -- validation: stages 1 and 2 outside any step and its cache ------------------------------------------

    def validation_rollout(
        self, step: int, *, prompts: TensorDict, sampling: SamplingParams, label: str
    ) -> StageResult:
        arguments = {"workers": self.workers, "prompts": prompts, "step": step, "sampling": sampling}
        return self._task(GENERATE, label, "validation")(**arguments, keep_extras=True)

    def validation_reward(
        self, *, batch: TensorDict, tokenizer, scorer: Scorer | None, ray_chunks: int, label: str, combine: str
    ) -> StageResult:
        arguments = {"batch": batch, "tokenizer": tokenizer, "custom_scorer": scorer, "ray_chunks": ray_chunks}
        return self._task(REWARD, label, "validation")(**arguments, keep_extras=True, combine=combine)

    def validation_reward_model(self, *, batch: TensorDict, tokenizer, model_reward, label: str) -> StageResult:
        arguments = {"batch": batch, "tokenizer": tokenizer, "model_reward": model_reward}
        return self._task(REWARD_MODEL, label, "validation")(**arguments)

    # -- how every stage is called -------------------------------------------------------------------------

    def together(self, step: StepData, calls: list[StageCall]) -> None:
        """Run stage calls of ``step`` none of which reads another's result side by side: each is its own task
        run, all submitted before any is awaited. Results are merged in the order given, each timed from its
        submission to its end. Plain functions (not orchestrated) run one after the other."""
        if not self.orchestrated or len(calls) < 2:
            for call in calls:
                self._call(step, call)
            return
        started = [(call.stage, self._start_in(step, call, background=True)) for call in calls]
        for stage, pending in started:
            waited = time.perf_counter()
            result = pending.result()
            seconds = pending.background_seconds  # None: a replayed result, loaded just now when awaited
            step.add_time(stage.timing, seconds if seconds is not None else time.perf_counter() - waited)
            step.merge(result)

    def _call(self, step: StepData, call: StageCall) -> StageResult:
        """Run ``call`` for ``step`` and merge its result, timed as ``timing_s/<its timing name>``."""
        with step.timed(call.stage.timing):
            result = self._start_in(step, call, background=False).result()
        return step.merge(result)

    def _start_in(self, step: StepData, call: StageCall, *, background: bool) -> PendingStage:
        return self._start(
            call.stage, step.step, call.arguments, label=step.label, background=background, batch=step.batch
        )

    def _start(
        self,
        stage: Stage,
        step: int,
        arguments: dict[str, Any],
        *,
        label: str,
        background: bool,
        batch: TensorDict | None = None,
        fit: Callable[[TensorDict], TensorDict] | None = None,
    ) -> PendingStage:
        """Start ``stage`` for ``step`` through its cache, as the stage's policy says: a result computed from
        another batch (or, for a forward pass, other weights), or a rollout sampled another way, is not replayed."""
        cache, requires, identity, meta = self.caches.get(stage.name), None, None, None
        if cache is not None and cache.covers(step):
            if stage.matches_input:
                role = getattr(self.workers, stage.weights) if stage.weights else None
                weights = role.weights_digest() if role else None
                requires = {"input_fingerprint": batch_fingerprint(batch, weights=weights)}
            if stage.sampled:
                identity, meta = self.rollout.identity, self.rollout.record()
        task = self._task(stage, label)
        return start_stage(
            cache,
            task,
            step,
            arguments,
            requires=requires,
            identity=identity,
            meta=meta,
            fit=fit,
            background=background,
        )

    def _task(self, stage: Stage, label: str, kind: str = "train"):
        """The stage's Prefect task, named ``<name>[<label>]`` and tagged; its plain function when not orchestrated."""
        if not self.orchestrated:
            return stage.task.fn
        tags = None if self.tags is None else {f"stage:{stage.name}", f"kind:{kind}", *self.tags}
        return stage.task.named(f"{stage.name}[{label}]", tags)
