"""The step cache: a stage's result per training step on any fsspec storage, replayed as Prefect
task-result caching (verl's SkipManager ``cache`` and ``repeat``, made safe).

One home, in the order a reader meets it:

* :mod:`.manifest` - the layout (verl's ``{dump_dir}/{experiment}_{project}/GBS.._N.._in.._out../{step}/``)
  and the commit marker of an entry, as pure functions;
* :mod:`.store` - :class:`StepCache`, one stage's entries: atomic writes, cheap validity, ``cache`` /
  ``repeat`` resolution over valid entries only, verified loads (size, sha256, safetensors; nothing is
  unpickled);
* :mod:`.scan` - every entry under a root, for the CLI and the regression replay;
* :mod:`.remap` - fitting a cached rollout onto this step's prompts (verl's V1 uid remap);
* :mod:`.prefect` - what Prefect persists (the marker, through :class:`ManifestSerializer`) and how
  its record of an entry is derived from the marker, never read from the cache;
* :mod:`.stage_cache` - calling a stage through its cache (:func:`start_stage`): the rules, applied
  from outside the stage's body;
* :mod:`.sample_cache` - the same entries one prompt's group at a time, keyed by feed order (verl's
  ``skip.async_rollout``), read and written by the rollout service's agent-loop workers.

This package exports the storage side only; the Prefect side (:mod:`.prefect`, :mod:`.stage_cache`) is
imported from its modules, so that the workers, which read the layout's names through the config, never
pay for importing Prefect. The store and the remap load on first use: the config reads the layout's names
from :mod:`.manifest`, and ``ppoflow config`` must not pay for the torch that the payloads' codec imports.
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
