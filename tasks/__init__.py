"""The PPO stages, one Prefect task each, in the order a step runs them.

Tasks are thin: they call a long-lived worker (through ``workers.group``) or a pure function from
``tasks.algorithms`` and return its result. None of them hashes its inputs (``NO_CACHE``): batches
are tensors, and hashing them would cost more than the stage.
"""

from tasks.advantage import advantage
from tasks.generate import generate
from tasks.log_prob import old_log_prob, ref_log_prob
from tasks.reward import reward
from tasks.update import update_actor, update_critic
from tasks.values import values
from tasks.weight_sync import weight_sync

STAGES = ("generate", "reward", "old_log_prob", "ref_log_prob", "values", "advantage", "update_critic",
          "update_actor", "weight_sync")

__all__ = list(STAGES)
