"""Trainer modes: who generates when, and when the new weights reach the rollout worker.

The training loop (:func:`ppoflow.flows.step.train_steps`) is the same for every mode and calls the mode's hooks
(verl's V1 trainer lifecycle) around the PPO step. :class:`TrainerMode` is the protocol: the hooks, ``sample``
(stage 1), ``push_weights`` (stage 6), ``updates_per_step`` and the checkpointed state. Two families implement it:
:class:`PerStepTrainer` (sync, one_step_off: each step's generation started as a stage) and the streaming modes
of :mod:`ppoflow.flows.async_modes` (a replay buffer). A new mode is a subclass registered with
``@register_trainer("my_mode")``, which also declares its :class:`~ppoflow.configs.modes.ModeNeeds` to the config
(``needs``); ``trainer.v1.trainer_module`` names a file of such classes. Details: docs/architecture.md.
"""

from __future__ import annotations

import logging
import sys
from typing import ClassVar

from ppoflow.configs.modes import MODE_NEEDS, ModeNeeds, declare_mode
from ppoflow.flows.cached_stages.calls import PendingStage
from ppoflow.flows.run import RunContext
from ppoflow.flows.stages import StepData
from ppoflow.flows.state import TrainerState
from ppoflow.storage.batch import StageResult
from ppoflow.tasks.stages import GENERATE, WEIGHT_SYNC

logger = logging.getLogger(__name__)

TRAINER_MODES: dict[str, type[TrainerMode]] = {}
"""Every registered mode's class, in registration order (the built-in ones first)."""


def register_trainer(name: str):
    """Class decorator: make a :class:`TrainerMode` subclass available as ``trainer.mode=<name>``, and declare
    what it needs of the config: its own ``needs``, else the config's declaration of a built-in ``name``, else
    its base class's."""

    def register(cls: type[TrainerMode]) -> type[TrainerMode]:
        if name in TRAINER_MODES and not _same_definition(TRAINER_MODES[name], cls):
            raise ValueError(f"trainer mode {name!r} is already registered ({TRAINER_MODES[name].__qualname__})")
        if "needs" not in cls.__dict__ and name in MODE_NEEDS and name not in TRAINER_MODES:
            cls.needs = MODE_NEEDS[name]
        cls.name = name
        declare_mode(name, cls.needs)
        TRAINER_MODES[name] = cls
        return cls

    return register


def _same_definition(registered: type, new: type) -> bool:
    """Whether ``new`` is ``registered`` defined again: the same class in the same source file (a
    ``trainer.v1.trainer_module`` imported by a second run in one process), which replaces it."""
    source = [getattr(sys.modules.get(cls.__module__), "__file__", None) for cls in (registered, new)]
    return registered.__qualname__ == new.__qualname__ and source[0] is not None and source[0] == source[1]


def make_trainer(run: RunContext, state: TrainerState) -> TrainerMode:
    """The mode ``trainer.mode`` names."""
    name = run.cfg.trainer.mode
    if name not in TRAINER_MODES:
        raise ValueError(f"trainer.mode={name!r} is not a registered trainer mode; known: {', '.join(TRAINER_MODES)}")
    return TRAINER_MODES[name](run, state)


class TrainerMode:
    """The mode protocol: the lifecycle hooks (no-ops unless a mode needs them), stage 1 (:meth:`sample`) and
    stage 6 (:meth:`push_weights`), and what a checkpoint keeps of the mode."""

    name: ClassVar[str]
    needs: ClassVar[ModeNeeds] = ModeNeeds()
    """What the mode needs of the config (:func:`register_trainer` declares it to the config's rules)."""

    updates_per_step: int = 1
    """Sample-and-update rounds per step before ``on_step_end`` (separate_async: ``parameter_sync_step``)."""

    @property
    def batch_size(self) -> int:
        """Prompt groups per update (``data.train_batch_size``): what dynamic sampling fills."""
        return self.run.cfg.data.train_batch_size

    def __init__(self, run: RunContext, state: TrainerState):
        self.run, self.state = run, state
        self.synced_version = 0
        """The weight version the rollout worker serves."""

    def on_init_end(self) -> None:
        """The workers are up and a checkpoint, if any, restored (and its weights pushed)."""

    def on_train_begin(self, steps: range) -> None: ...

    def on_step_begin(self, step: StepData) -> None: ...

    def on_sample_begin(self, step: StepData) -> None: ...

    def on_sample_end(self, step: StepData) -> None: ...

    def on_step_end(self, step: StepData) -> None: ...

    def on_validate_begin(self, step: int) -> None: ...

    def on_validate_end(self, step: int) -> None: ...

    def on_train_end(self) -> None: ...

    def sample(self, step: StepData) -> None:
        """Stage 1: take the step's batch into ``step``."""
        raise NotImplementedError

    def sample_more(self, step: StepData, groups: int) -> StepData:
        """Stage 1 again for dynamic sampling (``algorithm.filter_groups``): a further batch for ``step``, in a
        StepData of its own, to replace ``groups`` filtered prompt groups."""
        raise NotImplementedError(f"trainer mode {self.name!r} does not support algorithm.filter_groups")

    def push_weights(self, again: bool = False) -> None:
        """Stage 6: the rollout worker takes the actor's current weights (``again``: the ones pushed last).
        A rollout colocated with the actor samples with the actor's own model: there is nothing to move,
        so no task runs."""
        run = self.run
        if run.workers.colocated:
            self.synced_version = self.state.weight_version
            return
        collective = run.cfg.actor_rollout_ref.rollout.weight_sync.backend != "object_store"
        version = self.synced_version if again else self.state.weight_version
        run.stages.weight_sync(version=version, collective=collective, again=again)
        if not again:
            self.synced_version = self.state.weight_version

    def state_dict(self) -> dict:
        """What a checkpoint must keep of the mode."""
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class PerStepTrainer(TrainerMode):
    """The per-step family: each step's batch comes from the generate stage (replayed from its step cache when
    that holds the step), started when it is needed unless the mode started it earlier; a batch that a
    restarted rollout worker sampled with other weights is generated again.

    Generation batches are numbered as the steps (uids, sample ids and the generate cache are keyed by that
    number), except under dynamic sampling, where a step may take several: they count on (verl's ``gen_steps``)."""

    def __init__(self, run: RunContext, state: TrainerState):
        super().__init__(run, state)
        self.in_flight: dict[int, PendingStage] = {}
        """Generation started for a step, not yet consumed."""
        self.launch_versions: dict[int, int] = {}
        """The weight version the rollout served when each in-flight generation started."""
        self.generations: dict[int, int] = {}
        """The generation batch of each step's in-flight generation."""
        self.gen_step = 0
        """Under dynamic sampling, the last generation batch started."""

    def on_sample_begin(self, step: StepData) -> None:
        """Start the step's generation unless it already runs (started a step ahead, or restored)."""
        if step.step not in self.in_flight:
            self.launch(step.step, background=False)

    def launch(self, step: int, *, background: bool, generation: int | None = None) -> None:
        """Start generating a batch for ``step`` (the next generation batch, or ``generation``) with the weights
        the rollout serves now; with ``background`` as a Prefect future that runs while this thread goes on
        (replays never start in the background)."""
        run = self.run
        if generation is None and run.cfg.algorithm.filter_groups.enable:
            self.gen_step = generation = self.gen_step + 1
        generation = step if generation is None else generation
        prompts = run.prompts(generation, *self.state.drawn_prompts(generation))
        self.launch_versions[step], self.generations[step] = self.synced_version, generation
        self.in_flight[step] = run.stages.generate(generation, prompts=prompts, background=background)

    def sample(self, step: StepData) -> None:
        """Stage 1: wait for the step's batch and take it into ``step``. A batch that a restarted rollout
        worker sampled with its initial weights is generated again, with the weights it should have had."""
        pending = self.in_flight.pop(step.step)
        generated = pending.result()
        if not _replayed(generated) and self.sampled_with_other_weights(step.step, generated):
            # The batch must come from the weights it was started with; if the actor has moved on since
            # (generation ran ahead), those are the weights pushed last, which the actor kept.
            moved_on = self.launch_versions.get(step.step, self.synced_version) != self.state.weight_version
            self.push_weights(again=moved_on)
            self.launch(step.step, background=False, generation=self.generations[step.step])
            pending = self.in_flight.pop(step.step)
            generated = pending.result()
            step.metrics["training/rollout_regenerated"] = 1.0
        self.launch_versions.pop(step.step, None)
        generation = self.generations.pop(step.step, step.step)
        if generation != step.step:  # a dynamic-sampling batch: the loop forgets only the step's own prompts
            self.state.finish_step(generation)
        step.merge(generated)
        if not _replayed(generated):  # a replayed batch's weight versions are history
            staleness = (step.step - 1 - step.batch["weight_version"]).float()
            step.metrics.update(
                {
                    "training/off_policy/trajectory_staleness/mean": float(staleness.mean()),
                    "training/off_policy/trajectory_staleness/max": float(staleness.max()),
                }
            )
        if pending.background_seconds is not None:
            gen = step.metrics.get(f"timing_s/{GENERATE.timing}", 0.0)
            step.metrics["timing_s/generate_async"] = pending.background_seconds
            step.metrics["perf/generate_overlap_ratio"] = max(0.0, 1 - gen / max(pending.background_seconds, 1e-9))

    def sampled_with_other_weights(self, step: int, generated: StageResult) -> bool:
        """Whether the batch came from other weights than the ones pushed before its generation started
        (Ray restarted a dead rollout worker, which then serves its initial weights)."""
        expected = self.launch_versions.get(step, self.synced_version)
        versions = generated.fields["weight_version"]
        if bool((versions == expected).all()):
            return False
        logger.warning(
            "step %d was generated with weight version %s instead of %d: the rollout worker was "
            "restarted; re-syncing its weights and generating again",
            step,
            sorted(set(versions.tolist())),
            expected,
        )
        return True

    def sample_more(self, step: StepData, groups: int) -> StepData:
        """The next generation batch (``data.gen_batch_size`` prompts, whatever ``groups``), generated now with
        the weights the step's batch was sampled with."""
        more = StepData(step.step, round=step.round)
        self.launch(step.step, background=False)
        self.sample(more)
        return more

    def state_dict(self) -> dict:
        """What a checkpoint must keep of the mode: a batch generated for a later step (its fields and its
        generation batch), and the last generation batch started."""
        return {
            "in_flight": {str(step): pending.result().fields for step, pending in self.in_flight.items()},
            "generations": {str(step): generation for step, generation in self.generations.items()},
            "gen_step": self.gen_step,
        }

    def load_state_dict(self, state: dict) -> None:
        for step, fields in state.get("in_flight", {}).items():
            self.in_flight[int(step)] = PendingStage.done(StageResult(fields))
            self.launch_versions[int(step)] = int(fields["weight_version"].max())
        self.generations = {int(step): int(generation) for step, generation in state.get("generations", {}).items()}
        self.gen_step = int(state.get("gen_step", 0))


def _replayed(generated: StageResult) -> bool:
    return generated.metrics.get(f"skip/{GENERATE.skip}/hit") == 1.0


@register_trainer("sync")
class SyncTrainer(PerStepTrainer):
    """Generate, train, then push the new weights: every sample comes from the current policy."""

    def on_step_end(self, step: StepData) -> None:
        with step.timed(WEIGHT_SYNC.timing):
            self.push_weights()


@register_trainer("one_step_off")
class OneStepOffTrainer(PerStepTrainer):
    """verl's one-step-off order: wait for the batch generated during the previous step (with the weights
    before that step's update), push the current weights, start generating the next batch, then train on
    this one. Generation overlaps training and every sample is exactly one update old. A step that the
    rollout cache will replay starts no generation."""

    def on_train_begin(self, steps: range) -> None:
        self.last_step = steps[-1] if steps else 0

    def on_sample_begin(self, step: StepData) -> None:
        if step.step not in self.in_flight:  # the first step, or one after a replayed step
            self.launch(step.step, background=True)

    def on_sample_end(self, step: StepData) -> None:
        with step.timed("sync_rollout_weights"):
            with step.timed(WEIGHT_SYNC.timing):
                self.push_weights()
            if step.step < self.last_step:
                self.launch(step.step + 1, background=True)

    def on_validate_begin(self, step: int) -> None:
        self.push_weights()  # validate this step's weights, not the ones the next batch samples with
