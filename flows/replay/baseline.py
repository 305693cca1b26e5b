"""A regression replay's golden baseline on storage: ``baseline.json`` (per-step metrics, the config's
fingerprint, the code version), the cache settings a recording and its replays share, and whether the
recorded cache is complete."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from ppoflow.configs import DEMO_NAME, config_as_dict
from ppoflow.configs.schema import PPOConfig
from ppoflow.storage.fs import atomic_write, join, normalize_url, open_fs
from ppoflow.storage.step_cache import ROLLOUT_STAGE

FORMAT_VERSION = 1
BASELINE_FILE = "baseline.json"

FORCED = ("trainer.test_freq=-1",)
"""Overrides of both the recording and the replay: validation generates, so it is off."""


class ReplayError(Exception):
    """A replay cannot be recorded or checked as asked (no baseline, an incomplete cache, bad arguments)."""


def config_fingerprint(cfg: PPOConfig) -> str:
    """sha256 of the validated config as canonical JSON, without the keys that legitimately differ
    between a recording and its replays: ``trainer.default_local_dir`` and ``skip.*``."""
    data = config_as_dict(cfg)
    data.pop("skip", None)
    data.get("trainer", {}).pop("default_local_dir", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def code_version() -> dict[str, str | None]:
    """The installed ppoflow version and the git commit of this checkout (None where unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("ppoflow")
    except PackageNotFoundError:
        package = None
    checkout = Path(__file__).resolve().parents[2]
    try:
        toplevel, commit = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=checkout,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError, ValueError):
        commit = None
    else:  # not the commit of some repository the package happens to be installed inside
        commit = commit if Path(toplevel).resolve() == checkout else None
    return {"ppoflow": package, "git_commit": commit}


def cache_overrides(directory: str, steps: int) -> list[str]:
    """The rollout-cache overrides shared by the recording and its replays."""
    key = f"skip.{ROLLOUT_STAGE}"
    return [
        f"{key}.enable=true",
        f"{key}.action=cache",
        f"{key}.dump_dir={join(directory, 'cache')}",
        f"{key}.steps=[{','.join(str(step) for step in range(1, steps + 1))}]",
    ]


def config_name(config: str | None) -> str:
    """A preset name as given; a YAML path made absolute (a replay may run from another directory)."""
    if not config:
        return DEMO_NAME
    return str(Path(config).expanduser().resolve()) if config.endswith((".yaml", ".yml")) else config


def total_steps(cfg: PPOConfig) -> int:
    steps = cfg.trainer.total_training_steps
    if not steps:
        raise ReplayError("a replay baseline needs a fixed number of steps: set trainer.total_training_steps=N")
    return steps


def write_baseline(directory: str, baseline: dict) -> None:
    """Write ``directory/baseline.json`` atomically."""
    fs, root = open_fs(normalize_url(directory))
    fs.makedirs(root, exist_ok=True)
    atomic_write(fs, f"{root}/{BASELINE_FILE}", (json.dumps(baseline, indent=1) + "\n").encode())


def load_baseline(directory: str) -> dict:
    """The baseline recorded under ``directory``; :class:`ReplayError` when there is none."""
    directory = normalize_url(directory)
    fs, root = open_fs(directory)
    path = f"{root}/{BASELINE_FILE}"
    if not fs.exists(path):
        raise ReplayError(
            f"no replay baseline at {join(directory, BASELINE_FILE)}; "
            f"record one first: ppoflow replay record --dir {directory} [key=value ...]"
        )
    try:
        baseline = json.loads(fs.cat_file(path).decode())
    except ValueError as error:
        raise ReplayError(f"unreadable replay baseline {join(directory, BASELINE_FILE)}: {error}") from None
    if not isinstance(baseline, dict) or baseline.get("format_version") != FORMAT_VERSION:
        raise ReplayError(f"{join(directory, BASELINE_FILE)} is not a format-{FORMAT_VERSION} replay baseline")
    return baseline


def missing_cache_steps(cfg: PPOConfig, steps: int) -> list[tuple[int, str]]:
    """``(step, reason)`` for each of steps 1..``steps`` without a valid rollout entry in ``cfg``'s cache."""
    from ppoflow.configs.cache_settings import run_cache_dir, storage_settings
    from ppoflow.storage.step_cache import StepCache

    skip = cfg.skip[ROLLOUT_STAGE]
    cache = StepCache(run_cache_dir(skip, cfg), storage_options=storage_settings(skip))
    statuses = [cache.status(step) for step in range(1, steps + 1)]
    return [(status.step, f"{cache.step_url(status.step)}: {status.reason}") for status in statuses if not status.valid]
