"""Shared by tests/test_agent_loop*.py: hand-built multi-turn trajectories."""

from __future__ import annotations

from ppoflow.workers.service.agent_loop import AgentLoopOutput


def multi_turn_outputs() -> list[AgentLoopOutput]:
    """Two hand-built trajectories: model, tool, model (with EOS 2); and a single turn."""
    first = AgentLoopOutput(
        [7, 8],
        [10, 11, 20, 21, 12, 2],
        [1, 1, 0, 0, 1, 1],
        [-0.1, -0.2, 0, 0, -0.3, -0.4],
        [1, 1, -1, -1, 2, 2],
        num_turns=3,
        tool_calls=1,
        weight_versions=(4, 5),
    )
    second = AgentLoopOutput([9], [13, 2], [1, 1], [-0.5, -0.6], [1, 1], num_turns=1, weight_versions=(5, 5))
    return [first, second]
