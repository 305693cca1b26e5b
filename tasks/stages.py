"""Every stage of a PPO step, declared once as a :class:`Stage`: its Prefect task, its names (task,
``skip.<key>``, ``timing_s/<name>``), the role whose weights its result depends on, and how a cached result of it
is matched and fitted when replayed. The flow calls them through :class:`ppoflow.flows.stages.Stages`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.tasks.advantage import advantage
from ppoflow.tasks.generate import generate
from ppoflow.tasks.log_prob import old_log_prob, ref_log_prob
from ppoflow.tasks.reward import reward
from ppoflow.tasks.reward_model import reward_model
from ppoflow.tasks.sample import sample
from ppoflow.tasks.task_inputs import RecordedTask
from ppoflow.tasks.update import update_actor, update_critic
from ppoflow.tasks.values import values
from ppoflow.tasks.weight_sync import weight_sync


@dataclass(frozen=True)
class Stage:
    """One stage of a step.

    ``skip`` is its step-cache key (None: never cached); ``timing`` its ``timing_s/<timing>`` metric (verl's names:
    ``gen``, ``ref``, ``adv``, ``update_weights``). A cached result is replayed only for exactly the batch it was
    computed from and, for a forward pass, the exact weights of the role ``weights`` (``matches_input``); a rollout
    only if it was sampled the same way (the rollout identity), and then fitted onto this step's prompts
    (``sampled``)."""

    task: RecordedTask
    timing: str
    skip: str | None = None
    weights: str | None = None
    matches_input: bool = False
    sampled: bool = False

    @property
    def name(self) -> str:
        """The stage's name: its Prefect task's, its task runs' (``<name>[<label>]``), its ``stage:`` tag."""
        return self.task.name


GENERATE = Stage(generate, "gen", skip="rollout", sampled=True)
SAMPLE = Stage(sample, "gen")
"""Takes the place of :data:`GENERATE` in the streaming modes: the step's batch from the replay buffer."""
REWARD_MODEL = Stage(reward_model, "reward_model", skip="reward_model", weights="reward_model", matches_input=True)
REWARD = Stage(reward, "reward", skip="reward", matches_input=True)
OLD_LOG_PROB = Stage(old_log_prob, "old_log_prob", skip="old_log_prob", weights="actor", matches_input=True)
REF_LOG_PROB = Stage(ref_log_prob, "ref", skip="ref", weights="ref", matches_input=True)
VALUES = Stage(values, "values", skip="values", weights="critic", matches_input=True)
ADVANTAGE = Stage(advantage, "adv", skip="advantage", matches_input=True)
UPDATE_CRITIC = Stage(update_critic, "update_critic")
UPDATE_ACTOR = Stage(update_actor, "update_actor")
WEIGHT_SYNC = Stage(weight_sync, "update_weights")

STAGES = (
    GENERATE,
    SAMPLE,
    REWARD_MODEL,
    REWARD,
    OLD_LOG_PROB,
    REF_LOG_PROB,
    VALUES,
    ADVANTAGE,
    UPDATE_CRITIC,
    UPDATE_ACTOR,
    WEIGHT_SYNC,
)
"""In the order a step runs them."""
