"""Regression replay: a golden baseline of a few training steps, re-checked from its rollout cache.

:mod:`.flow` records a baseline and runs the ``regression-replay`` flow, :mod:`.baseline` reads and
writes it, :mod:`.compare` compares metrics (pure), :mod:`.cli` is ``ppoflow replay record|check``.
"""

from ppoflow.flows.replay.cli import add_commands
from ppoflow.flows.replay.flow import regression_replay

__all__ = ["add_commands", "regression_replay"]
