"""The streaming family, verl's V1 async trainer modes: the rollout generates without waiting for the trainer,
and the trainer takes its batches from a staleness-bounded replay buffer (:mod:`ppoflow.storage.replay_buffer`).

Prompts are fed one at a time in feed order (uids ``sample_{epoch}_{index}``) to the rollout service, whose
agent-loop workers return each prompt's group as it finishes; ``num_warmup_batches`` batches are fed ahead.
``colocate_async`` aborts and sleeps the replicas while the actor trains and resumes the aborted requests with the
new weights (partial rollout); ``separate_async`` never stops the replicas and pushes weights once per step, after
``parameter_sync_step`` updates (decoupled PPO). Details: docs/async_modes.md.
"""

from __future__ import annotations

import logging
from typing import ClassVar

from ppoflow.algorithms.scoring import ScorerFailed
from ppoflow.algorithms.user_code import import_module
from ppoflow.configs.stages import SAMPLE_CACHE_KEY
from ppoflow.flows.modes import TrainerMode, register_trainer
from ppoflow.flows.run import RunContext
from ppoflow.flows.stages import StepData
from ppoflow.flows.state import TrainerState
from ppoflow.storage.batch import NON_TENSOR_FIELDS, non_tensor_column, with_non_tensor_columns
from ppoflow.storage.replay_buffer import ReplayBuffer
from ppoflow.storage.step_cache.sample_cache import feed_index, sample_id
from ppoflow.tasks.stages import WEIGHT_SYNC
from ppoflow.workers.service.rollout_service import RolloutFailing

FAILED_GROUPS_IN_A_ROW = 2
"""Batches' worth of prompt groups whose generation may fail one after another (none finishing between them)
before the run stops: past that the rollout is broken, and feeding fresh prompts would only go on forever."""

logger = logging.getLogger(__name__)


class StreamingTrainer(TrainerMode):
    """The streaming family: feeding prompts to the rollout service, taking finished groups into the replay
    buffer, and sampling each step's batch from it. Nothing starts at ``on_sample_begin``: the rollout was fed
    in ``on_step_begin`` and generates on its own."""

    settings_key: ClassVar[str]
    """The mode's section under ``trainer.v1`` (``num_warmup_batches``, ...)."""

    def __init__(self, run: RunContext, state: TrainerState):
        super().__init__(run, state)
        sampler = run.cfg.trainer.v1.sampler
        buffer_class = load_sampler(sampler.custom_sampler.path, sampler.custom_sampler.name)
        self.buffer = buffer_class(
            pad_token_id=run.tokenizer.pad_token_id,
            max_off_policy_threshold=sampler.max_off_policy_threshold,
            max_off_policy_strategy=sampler.max_off_policy_strategy,
            refill=self.refill,
        )
        self.settings = getattr(run.cfg.trainer.v1, self.settings_key)
        self.generating: dict = {}
        """Reference to a prompt group being generated -> the prompt's uid."""
        self.failed_in_a_row = 0
        self.prompts: dict[str, int] = {}
        """uid -> train-set row of every prompt fed and not trained yet."""
        self.dispatch_step = 1
        """The step prompts fed now are dispatched at (the step being trained, or the first)."""

    # -- feeding the rollout --------------------------------------------------------------------------

    def feed(self, count: int) -> None:
        """Send the next ``count`` prompts of the feed to the rollout service, dispatched now."""
        if count == 0:
            return
        fed = self.state.feed(count)
        uids = [sample_id(epoch, index) for index, epoch, _ in fed]
        self.prompts.update({uid: row for uid, (_, _, row) in zip(uids, fed)})
        self.buffer.add_prompts(uids, self.dispatch_step)
        self.submit(uids)

    def submit(self, uids: list[str]) -> None:
        """Start generating the groups of prompts already in the buffer (as pending), one reference each."""
        run = self.run
        prompts = run.train_set.batch([self.prompts[uid] for uid in uids], uids, run.tokenizer.pad_token_id)
        prompts = with_non_tensor_columns(prompts, {"sample_id": uids})
        sent = prompts.exclude("uid") if run.workers.streams_reward else prompts.exclude(*NON_TENSOR_FIELDS)
        for position, uid in enumerate(uids):
            reference = run.workers.rollout.submit_group(
                sent[position : position + 1],
                position=feed_index(uid) - 1,
                step=self.dispatch_step,
                sampling=run.sampling,
            )
            self.generating[reference] = uid
            self.buffer.mark_running(uid)

    def refill(self, count: int) -> None:
        """The buffer evicted ``count`` groups (too stale, or failed): feed as many fresh prompts."""
        self.feed(count)

    def poll(self, timeout_s: float) -> None:
        """Take the groups that finished (waiting up to ``timeout_s`` for one) into the buffer; a group whose
        generation failed is marked failed (the buffer evicts and refills it), unless groups have failed for
        :data:`FAILED_GROUPS_IN_A_ROW` batches in a row (:class:`RolloutFailing`)."""
        if not self.generating:
            raise RuntimeError("the replay buffer is waiting for groups but none is being generated")
        for reference in self.run.workers.ready(list(self.generating), timeout_s):
            uid = self.generating.pop(reference)
            try:
                self.buffer.finish(uid, self.run.workers.get(reference))
                self.failed_in_a_row = 0
            except ScorerFailed as failure:  # the user's scorer: never retried, the run fails naming it
                raise getattr(failure, "cause", failure) from None  # as raised in the worker, without Ray's trace
            except Exception as error:  # the group's generation failed (a worker died, a loop raised)
                reason = repr(getattr(error, "cause", None) or error)  # a loop's own error, without Ray's trace
                logger.warning("generating prompt %s failed: %s", uid, reason)
                self.failed_in_a_row += 1
                if self.failed_in_a_row >= FAILED_GROUPS_IN_A_ROW * self.batch_size:
                    raise RolloutFailing(
                        f"the last {self.failed_in_a_row} prompt groups generated all failed, the last with {reason}"
                    ) from None
                self.buffer.fail(uid, reason)

    # -- the lifecycle ---------------------------------------------------------------------------------

    def on_train_begin(self, steps: range) -> None:
        """Feed the warm-up batches (verl: ``num_warmup_batches``), dispatched at the first step; a resumed
        run dispatches again the prompts that were in flight when its checkpoint was written instead (verl's
        ``_reissue_inflight_prompts``: their rollout died with the old process)."""
        self.dispatch_step = steps[0] if steps else 1
        in_flight = list(self.buffer.in_flight())
        if not in_flight:
            self.feed(self.warmup_prompts)
            return
        for uid in in_flight:
            self.buffer.reissue(uid, self.dispatch_step)
        self.submit(in_flight)

    @property
    def warmup_prompts(self) -> int:
        """Prompts fed before the first step: ``num_warmup_batches`` batches, or none when the samples are
        cached (``skip.async_rollout``): then every step feeds and trains exactly its own batch, so which
        groups a step trains does not depend on which finished first, and a run that replays its samples
        trains exactly as the run that recorded them (verl skips the warm-up under its V1 skip too)."""
        if self.replayable:
            return 0
        return self.run.cfg.data.train_batch_size * self.settings.num_warmup_batches

    @property
    def replayable(self) -> bool:
        """Whether the run caches its samples (``skip.async_rollout``), and so must train deterministically."""
        cache = self.run.cfg.skip.get(SAMPLE_CACHE_KEY)
        return cache is not None and cache.enable

    def on_step_begin(self, step: StepData) -> None:
        """Feed this step's prompts, ``train_batch_size`` of them (verl's ``prepare_step``): the rollout
        stays that far ahead."""
        self.dispatch_step = step.step
        self.feed(self.run.cfg.data.train_batch_size)

    def sample(self, step: StepData, groups: int | None = None) -> None:
        """Stage 1: the step's batch, the oldest ``groups`` (default: :attr:`batch_size`) finished groups in the
        buffer (the ``sample`` task)."""
        batch_size = groups or self.batch_size
        result = self.run.stages.sample(
            step, buffer=self.buffer, batch_size=batch_size, poll=self.poll, in_order=self.replayable
        )
        uids = non_tensor_column(result.fields, "uid")
        rows = [self.prompts[uid] for uid in uids]
        columns = self.run.train_set.reward_columns(rows)
        step.merge(type(result)(with_non_tensor_columns(result.fields, columns), result.metrics))
        for uid in set(uids):
            del self.prompts[uid]

    def sample_more(self, step: StepData, groups: int) -> StepData:
        """Dynamic sampling's refill, as verl's V1 buffer evicts filtered groups: feed ``groups`` fresh prompts
        and sample as many groups (the oldest finished, as :meth:`sample`)."""
        more = StepData(step.step, round=step.round)
        self.feed(groups)
        self.sample(more, groups)
        return more

    def on_train_end(self) -> None:
        """End the generations still running - prompts fed ahead of the last step - before the run's actors
        are killed, so the run ends without a failed request on a killed replica."""
        self.run.workers.rollout.cancel(list(self.generating))
        self.generating.clear()

    def push_weights(self, again: bool = False) -> None:
        """Every replica takes the actor's weights; a replica Ray restarted gets them too."""
        super().push_weights(again)
        self.run.workers.rollout.resync_restarted()

    def state_dict(self) -> dict:
        """The buffer (finished groups; prompts in flight, re-issued on resume) and the train-set rows of
        the prompts not trained yet. Taken between steps, so no trained prompt is in it."""
        return {"buffer": self.buffer.state_dict(), "prompts": {uid: row for uid, row in self.prompts.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Take back a checkpoint's buffer and prompts; ``on_train_begin`` dispatches those in flight again."""
        self.buffer.load_state_dict(state["buffer"])
        self.prompts = {uid: int(row) for uid, row in state["prompts"].items()}


@register_trainer("colocate_async")
class ColocateAsyncTrainer(StreamingTrainer):
    """Rollout and training take turns on shared resources, with partial rollout (see the module docstring)."""

    settings_key = "colocate_async"

    def on_sample_end(self, step: StepData) -> None:
        """Abort what the replicas generate and let them sleep while the actor trains (verl's
        ``abort_replicas`` + ``sleep_replicas``)."""
        aborted = sum(self.run.workers.get(self.run.workers.rollout.sleep()))
        step.metrics["rollout/aborted_requests"] = float(aborted)

    def on_step_end(self, step: StepData) -> None:
        """Load the new weights into the replicas, then wake them: the aborted requests resume."""
        with step.timed(WEIGHT_SYNC.timing):
            self.push_weights()
        self.run.workers.get(self.run.workers.rollout.wake())


@register_trainer("separate_async")
class SeparateAsyncTrainer(StreamingTrainer):
    """The rollout generates without pause on resources of its own; the weights are pushed once per step."""

    settings_key = "separate_async"

    @property
    def batch_size(self) -> int:
        """Prompt groups per mini-batch update: ``train_batch_size / parameter_sync_step``."""
        return self.run.cfg.data.train_batch_size // self.settings.parameter_sync_step

    @property
    def updates_per_step(self) -> int:
        """``parameter_sync_step``: sample-and-update rounds between two weight pushes."""
        return self.settings.parameter_sync_step

    def on_sample_begin(self, step: StepData) -> None:
        """Before a step's first update, keep the actor's weights: every round's old log-probs come from
        them (decoupled PPO, verl's version-aware ``_compute_old_log_prob``)."""
        if step.round == 0 and self.updates_per_step > 1:
            self.run.workers.actor.snapshot_weights()
        if step.round > 0:
            step.old_policy = "step_start"

    def on_step_end(self, step: StepData) -> None:
        """Push the step's weights; the replicas load them between two decoding steps and go on."""
        with step.timed(WEIGHT_SYNC.timing):
            self.push_weights()


def load_sampler(path: str | None, name: str | None) -> type[ReplayBuffer]:
    """The sampler class of ``trainer.v1.sampler.custom_sampler``: :class:`ReplayBuffer` when ``path`` and
    ``name`` are both None, else the class ``name`` of the Python file (or importable module) ``path``.

    The file is imported under a fresh module name (:func:`ppoflow.algorithms.user_code.import_module`, the
    project's one way of importing user code). The class must subclass :class:`ReplayBuffer`; as in verl it
    is built with the base keyword arguments only (``pad_token_id``, ``max_off_policy_threshold``,
    ``max_off_policy_strategy``, ``refill``). A file that is missing or fails to import, a missing class, or
    one that is not a subclass raises ``ValueError`` naming the config key.
    """
    key = "trainer.v1.sampler.custom_sampler"
    if path is None and name is None:
        return ReplayBuffer
    if not path or not name:
        raise ValueError(f"{key}.path and {key}.name must be set together, got path={path!r}, name={name!r}")
    try:
        module = import_module(path)
    except ValueError as error:
        raise ValueError(f"{key}.path={path!r}: {error}") from None
    sampler = getattr(module, name, None)
    if sampler is None:
        raise ValueError(f"{key}.name={name!r}: {path} defines no such class")
    if not (isinstance(sampler, type) and issubclass(sampler, ReplayBuffer)):
        raise ValueError(f"{key}.name={name!r} in {path} is not a subclass of {ReplayBuffer.__module__}.ReplayBuffer")
    return sampler
