"""Which entry a stage call of a step replays, and what became of each planned step.

:meth:`StageCache.plan` applies verl's rules (``cache``: this step's entry; ``repeat``: the nearest valid one) to one
stage's entries; :func:`stage_caches` builds the run's caches from ``skip.<key>``. What became of each planned step
is kept in :attr:`StageCache.outcomes` for the run's report (:mod:`ppoflow.flows.cache_report`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppoflow.configs.cache_settings import entry_size_bound, run_cache_dir, storage_settings
from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.cached_stages.records import PrefectStore
from ppoflow.storage.bounded import client_timeouts
from ppoflow.storage.fs import normalize_url, open_fs, remove_stale_temp_files
from ppoflow.storage.step_cache.entry_check import EntryCheck
from ppoflow.storage.step_cache.manifest import marker_name
from ppoflow.storage.step_cache.store import StepCache
from ppoflow.tasks.stages import STAGES


@dataclass(frozen=True)
class CachePlan:
    """How one stage call of one step uses the cache."""

    step: int
    load_step: int | None  # the entry to replay (``step`` itself or repeat's substitute); None = compute and dump
    key: str  # Prefect cache key: the marker path relative to dump_dir

    @property
    def hit_expected(self) -> bool:
        return self.load_step is not None


OUTCOMES = ("replayed", "rejected", "missing", "unreadable")


@dataclass(frozen=True)
class StepOutcome:
    """What became of one planned step (one of :data:`OUTCOMES`): ``replayed`` (``detail``: the step whose
    entry ``repeat`` replayed, when another), ``rejected`` (``detail``: why; then computed and written),
    ``missing`` (no entry to replay: computed and written), ``unreadable`` (``detail``: the store's error;
    computed without the cache)."""

    step: int
    outcome: str
    detail: str = ""


class StageCache:
    """One stage's step cache in a run: its entries, the steps it covers, its action, its Prefect store.

    ``key`` is the stage's cache key (``skip.<key>``, ``skip/<key>/*`` metrics); ``root`` the run's
    configuration directory under ``dump_dir``. Every storage call is bounded by ``timeout_s`` and a
    failed write is retried ``retries`` times; ``allow_mismatch`` replays entries whose recorded
    requirements differ (logging the differences); an entry larger than ``max_entry_bytes`` (more than a
    step of this run can hold) is refused before it is read. ``outcomes`` records what became of each
    planned step the run reached (its first call: a step's first round).
    """

    def __init__(
        self,
        key: str,
        dump_dir: str,
        root: str,
        *,
        steps: list[int],
        action: str,
        storage_options: dict,
        timeout_s: float,
        retries: int,
        allow_mismatch: bool,
        max_entry_bytes: int,
    ):
        self.key, self.steps, self.action = key, frozenset(steps), action
        self.timeout_s, self.allow_mismatch, self.max_entry_bytes = timeout_s, allow_mismatch, max_entry_bytes
        options = client_timeouts(dump_dir, storage_options, timeout_s=timeout_s, retries=retries)
        self.entries = StepCache(root, stage=key, storage_options=options, write_retries=retries)
        remove_stale_temp_files(*open_fs(self.entries.root, options))  # left by writes a crash interrupted
        self.dump_dir, self.storage_options = dump_dir, options
        self.prefix = self.entries.root[len(dump_dir) :].strip("/")
        self.store = PrefectStore(dump_dir, options)
        self.outcomes: dict[int, StepOutcome] = {}

    def covers(self, step: int) -> bool:
        return step in self.steps

    def plan(self, step: int) -> CachePlan:
        """verl's rules: ``cache`` replays this step's committed entry (one with a marker, valid or not: the
        replay judges it, so a damaged entry is a rejected replay, not a silent recomputation), ``repeat``
        the nearest valid one."""
        if self.action == "cache":
            load_step = step if self.entries.has_marker(step) else None
        else:
            load_step = self.entries.resolve(step, self.action)
        return self.plan_dump(step) if load_step is None else CachePlan(step, load_step, self.record_key(load_step))

    def plan_dump(self, step: int) -> CachePlan:
        """Compute the stage and dump it at ``step`` (replacing whatever entry was there)."""
        return CachePlan(step, None, self.record_key(step))

    def record_key(self, step: int) -> str:
        return f"{self.prefix}/{step}/{marker_name(self.key)}"

    def task_options(self, plan: CachePlan, check: EntryCheck | None = None) -> dict:
        """A replay's task options (with its ``check``) or a dump's."""
        return self.store.task_options(plan.key, check=check)

    def check(self, plan: CachePlan, requires: dict, identity: dict) -> EntryCheck:
        """What the planned entry must pass to be replayed (see :class:`~.prefect.EntryCheck`)."""
        return EntryCheck(
            root=self.entries.root,
            stage=self.key,
            step=plan.load_step,
            settings=self.storage_options,
            requires=requires,
            identity=identity,
            allow_mismatch=self.allow_mismatch,
            max_bytes=self.max_entry_bytes,
        )

    def note(self, step: int, outcome: str, detail: str = "") -> None:
        """Record what became of planned ``step`` (its first call only)."""
        self.outcomes.setdefault(step, StepOutcome(step, outcome, detail))


def stage_caches(cfg: PPOConfig) -> dict[str, StageCache]:
    """The run's enabled step caches, keyed by stage name."""
    caches = {}
    for stage in STAGES:
        skip = cfg.skip.get(stage.skip) if stage.skip else None
        if skip is not None and skip.enable:
            caches[stage.name] = StageCache(
                stage.skip,
                normalize_url(skip.dump_dir),
                run_cache_dir(skip, cfg),
                steps=skip.steps,
                action=skip.action,
                storage_options=storage_settings(skip),
                timeout_s=skip.timeout_s,
                retries=skip.retries,
                allow_mismatch=skip.allow_mismatch,
                max_entry_bytes=entry_size_bound(cfg),
            )
    return caches
