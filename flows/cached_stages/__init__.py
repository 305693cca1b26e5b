"""Calling a stage through its step cache, as Prefect task-result caching: :mod:`.planning` (which entry a call
replays, verl's ``cache``/``repeat``), :mod:`.calls` (replaying or computing and dumping, pending calls) and
:mod:`.records` (what Prefect persists and reads: the record derived from an entry's marker). The bytes, layout and
checks are :mod:`ppoflow.storage.step_cache`. The tour: docs/step_cache.md#where-it-lives.
"""
