"""Regression replay: a golden baseline of a few training steps, re-checked from its rollout cache.

:mod:`.flow` records a baseline and runs the ``regression-replay`` flow, :mod:`.baseline` reads and
writes it, :mod:`.compare` compares metrics (pure), :mod:`.cli` is ``ppoflow replay record|check``.
The exports load on first use, so that ``ppoflow --help`` (which adds the replay commands) never imports
Prefect.
"""

import importlib

_EXPORTS = {"add_commands": "cli", "regression_replay": "flow"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
