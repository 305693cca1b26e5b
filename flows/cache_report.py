"""What a run's step caches did with the steps they were to replay, said once at the run's end.

For each enabled ``skip.<key>``, of its planned steps (those of ``skip.<key>.steps`` the run reached): how
many were replayed, rejected (each with its step and why), missing (no entry: computed and written) and
unreadable (the store failed). A run's entries live in a directory named for its experiment, project and
shape (``{experiment}_{project}/GBS{gbs}_N{n}_in{P}_out{R}``, :func:`~ppoflow.storage.step_cache.config_dir`),
so a replay under another ``trainer.experiment_name`` finds nothing and recomputes every step: when the
cache holds the missing steps' entries under another such directory, the report says where, and which
config keys differ. :func:`report_caches` logs one line per cache (a warning when planned replays did not
happen for a reason to act on) and returns the lines of the summary artifact's "Step cache" section.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.cached_stages.planning import OUTCOMES, StageCache, StepOutcome
from ppoflow.storage.bounded import bounded
from ppoflow.storage.step_cache import scan
from ppoflow.storage.step_cache.manifest import shape_values

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Elsewhere:
    """Another configuration directory holding valid entries of missing ``steps``, and how its configuration
    differs from the run's."""

    directory: str
    steps: list[int]
    differences: list[str]

    def __str__(self) -> str:
        steps = ", ".join(map(str, self.steps))
        return f"step{'s' if len(self.steps) > 1 else ''} {steps} under {self.directory}, where " + ", ".join(
            self.differences
        )


@dataclass(frozen=True)
class CacheReport:
    """One stage cache's planned steps by outcome; ``elsewhere``: the other configuration directories
    holding entries of its missing steps."""

    key: str
    outcomes: dict[str, list[StepOutcome]]
    elsewhere: list[Elsewhere]

    @property
    def planned(self) -> int:
        return sum(len(steps) for steps in self.outcomes.values())

    @property
    def needs_attention(self) -> bool:
        """Whether planned replays did not happen for a reason to act on: an entry rejected, a store that
        failed, or entries kept under another configuration."""
        return bool(self.outcomes["rejected"] or self.outcomes["unreadable"] or self.elsewhere)

    def line(self) -> str:
        """``replayed 0 of 5 planned steps of rollout: 5 missing (...)``."""
        parts = []
        if self.outcomes["rejected"]:
            parts.append(
                f"{len(self.outcomes['rejected'])} rejected ("
                + "; ".join(f"step {o.step}: {o.detail}" for o in self.outcomes["rejected"])
                + ")"
            )
        if self.outcomes["missing"]:
            parts.append(f"{len(self.outcomes['missing'])} missing ({self.missing_detail()})")
        if self.outcomes["unreadable"]:
            parts.append(
                f"{len(self.outcomes['unreadable'])} unreadable, computed without the cache ("
                + "; ".join(f"step {o.step}: {o.detail}" for o in self.outcomes["unreadable"])
                + ")"
            )
        return self.headline() + (": " + ", ".join(parts) if parts else "")

    def headline(self) -> str:
        return f"replayed {len(self.outcomes['replayed'])} of {self.planned} planned steps of {self.key}"

    def missing_detail(self) -> str:
        if not self.elsewhere:
            return "no entry to replay: computed and written"
        return f"no entry under this run's configuration; the cache holds {'; '.join(map(str, self.elsewhere))}"

    def markdown(self) -> list[str]:
        """The cache's bullet in the summary, with one sub-bullet per rejected step."""
        lines = [
            f"- {self.headline()} (`skip.{self.key}`)"
            + "".join(
                f", {len(self.outcomes[outcome])} {outcome}" for outcome in OUTCOMES[1:] if self.outcomes[outcome]
            )
        ]
        lines += [f"  - step {o.step} rejected: {o.detail}" for o in self.outcomes["rejected"]]
        if self.outcomes["missing"]:
            lines.append(f"  - missing: {self.missing_detail()}")
        lines += [f"  - step {o.step} unreadable: {o.detail}" for o in self.outcomes["unreadable"]]
        return lines


def config_differences(here: str, there: str, *, experiment: str, project: str) -> list[str]:
    """The config keys that differ between two configuration directories (``{experiment}_{project}/GBS..``),
    ``key: value there, value here``; ``here`` is this run's, made of ``experiment`` and ``project``."""
    (here_project, here_shape), (there_project, there_shape) = here.split("/", 1), there.split("/", 1)
    differences = []
    if there_project != here_project:
        if there_project.endswith(f"_{project}"):
            differences.append(
                f"trainer.experiment_name is {there_project[: -len(project) - 1]!r} there, {experiment!r} here"
            )
        elif there_project.startswith(f"{experiment}_"):
            differences.append(
                f"trainer.project_name is {there_project[len(experiment) + 1 :]!r} there, {project!r} here"
            )
        else:
            differences.append(
                f"trainer.experiment_name and project_name make {there_project!r} there, {here_project!r} here"
            )
    here_values, there_values = shape_values(here_shape), shape_values(there_shape)
    if here_values is None or there_values is None:
        if there_shape != here_shape:
            differences.append(f"the shape is {there_shape!r} there, {here_shape!r} here")
        return differences
    differences += [
        f"{key} is {there_values[key]} there, {own} here"
        for key, own in here_values.items()
        if own != there_values[key]
    ]
    return differences


def report(cache: StageCache, cfg: PPOConfig) -> CacheReport:
    """What became of ``cache``'s planned steps; when some were missing, where the cache holds them instead
    (one listing of ``dump_dir``, bounded like every cache call; a store that fails leaves that out)."""
    outcomes = {outcome: [] for outcome in OUTCOMES}
    for step in sorted(cache.outcomes):
        outcomes[cache.outcomes[step].outcome].append(cache.outcomes[step])
    missing = {outcome.step for outcome in outcomes["missing"]}
    found: dict[str, list[int]] = {}
    if missing:
        try:
            entries = bounded(
                lambda: scan(cache.dump_dir, cache.storage_options),
                timeout_s=cache.timeout_s,
                what=f"listing {cache.dump_dir}",
            )
        except Exception as error:  # the report goes without the hint
            logger.info(
                "could not list %s to say where the missing %s entries are: %r", cache.dump_dir, cache.key, error
            )
            entries = []
        for entry in entries:  # sorted by directory, then step
            directory = f"{entry.project}/{entry.config}"
            if entry.stage == cache.key and entry.valid and entry.step in missing and directory != cache.prefix:
                found.setdefault(directory, []).append(entry.step)
    elsewhere = [
        Elsewhere(
            directory,
            steps,
            config_differences(
                cache.prefix, directory, experiment=cfg.trainer.experiment_name, project=cfg.trainer.project_name
            ),
        )
        for directory, steps in found.items()
    ]
    return CacheReport(cache.key, outcomes, elsewhere)


def report_caches(caches: dict[str, StageCache], cfg: PPOConfig) -> list[str]:
    """Log each cache's line (a warning when it :attr:`~CacheReport.needs_attention`) and return the
    markdown lines of the run summary's "Step cache" section (none without a planned step)."""
    lines = []
    for cache in caches.values():
        if not cache.outcomes:
            continue
        found = report(cache, cfg)
        logger.log(logging.WARNING if found.needs_attention else logging.INFO, "step cache: %s", found.line())
        lines += found.markdown()
    return lines
