"""The step cache's storage side: a stage's result per training step on any fsspec storage (verl's SkipManager
``cache`` and ``repeat``, made safe) as bytes, layout, manifest, checksums and scanning.

Modules in reading order: :mod:`.manifest` (layout, marker), :mod:`.store` (:class:`StepCache`), :mod:`.scan`,
:mod:`.remap`, :mod:`.entry_check` (an entry judged before a replay) and :mod:`.sample_cache` (verl's
``skip.async_rollout``). Replaying and dumping a stage through Prefect is :mod:`ppoflow.flows.cached_stages`. The
store and remap load on first use, so ``ppoflow config`` never pays for torch. The tour:
docs/step_cache.md#where-it-lives.
"""

import importlib

from ppoflow.storage.step_cache.manifest import ROLLOUT_STAGE, config_dir, marker_name, payload_name
from ppoflow.storage.step_cache.scan import CacheEntry, check_root, scan

_LAZY = {"remap_to_prompts": "remap", "CacheCorrupt": "store", "CacheWriteError": "store", "StepCache": "store"}

__all__ = [
    "ROLLOUT_STAGE",
    "CacheCorrupt",
    "CacheEntry",
    "CacheWriteError",
    "StepCache",
    "check_root",
    "config_dir",
    "marker_name",
    "payload_name",
    "remap_to_prompts",
    "scan",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
