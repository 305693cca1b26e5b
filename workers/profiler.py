"""Profiling a role's processes at chosen steps (verl's ``global_profiler`` and ``<role>.profiler``).

:class:`Profiles` is mixed into every worker class that can be profiled: between :meth:`Profiles.start_profile`
and :meth:`Profiles.stop_profile` the process records a torch profiler trace (``tool=torch``, CPU and CUDA
activity, Chrome trace format) or the CUDA allocator's history (``tool=torch_memory``, a snapshot for
pytorch.org/memory_viz), then writes it to ``<save_path>/step<N>/<roles>_rank<r>.json.gz`` (or ``.pickle``),
made locally and uploaded atomically to any fsspec URL. Stages are ``record_function`` ranges
(:mod:`ppoflow.workers.stage`). A failure to record or write warns and loses only that file. Details:
docs/trackers.md#profiler.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass

import torch

from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.schema_profiler import TORCH_CONTENTS, ProfilerConfig
from ppoflow.storage.fs import atomic_write, join, open_fs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileSettings:
    """What a profiled process needs to know, built once from the config by :meth:`of`."""

    tool: str
    save_path: str
    roles: dict[str, ProfilerConfig]
    """Role name -> its ``profiler`` section, for the roles whose ``enable`` is set."""
    memory: dict
    """``torch_memory``: the keyword arguments of ``torch.cuda.memory._record_memory_history``."""

    @classmethod
    def of(cls, cfg: PPOConfig) -> ProfileSettings | None:
        """The run's settings; None when nothing is profiled."""
        arr, profiler = cfg.actor_rollout_ref, cfg.global_profiler
        sections = {"actor": arr.actor, "ref": arr.ref, "rollout": arr.rollout, "critic": cfg.critic}
        roles = {name: section.profiler for name, section in sections.items() if section.profiler.enable}
        if not (profiler.tool and profiler.steps and roles):
            return None
        memory = profiler.global_tool_config.torch_memory
        return cls(
            tool=profiler.tool,
            save_path=profiler.save_path or join(cfg.trainer.default_local_dir, "profile"),
            roles=roles,
            memory={"max_entries": memory.trace_alloc_max_entries, "context": memory.context, "stacks": memory.stacks},
        )

    def roles_profiled(self, roles: tuple[str, ...], rank: int) -> list[str]:
        """Those of a process's ``roles`` that profile it at ``rank``."""
        return [
            role
            for role in roles
            if role in self.roles and (self.roles[role].all_ranks or rank in (self.roles[role].ranks or [0]))
        ]


class Profiles:
    """Mixed into a worker class: records this process between the calls of one profiled step.
    ``PROFILE_ROLES`` are the roles the process serves (a colocated actor also serves the rollout)."""

    PROFILE_ROLES: tuple[str, ...] = ()
    _recording: tuple | None = None

    def profile_rank(self) -> int:
        """This process's rank in its role's data-parallel group."""
        parallel = getattr(self, "parallel", None)
        return parallel.rank if parallel is not None else 0

    def start_profile(self, step: int, settings: ProfileSettings) -> bool:
        """Start recording ``step`` if a role of this process is profiled at its rank; whether it started."""
        rank = self.profile_rank()
        roles = settings.roles_profiled(self.PROFILE_ROLES, rank)
        if not roles:
            return False
        try:
            recorder = _start(settings, roles)
        except Exception as error:  # optional: the step goes on unprofiled
            logger.warning("could not start the %s profiler of %s: %r", settings.tool, "-".join(roles), error)
            return False
        self._recording = (recorder, settings, roles, step, rank)
        return True

    def stop_profile(self) -> list[str]:
        """Stop recording and write the file; its URL (none when nothing was recorded or the write failed)."""
        if self._recording is None:
            return []
        recorder, settings, roles, step, rank = self._recording
        self._recording = None
        suffix = "pickle" if settings.tool == "torch_memory" else "json.gz"
        url = join(settings.save_path, f"step{step}", f"{'-'.join(roles)}_rank{rank}.{suffix}")
        try:
            data = _stop(settings, recorder)
            fs, path = open_fs(url)
            atomic_write(fs, path, data)
        except Exception as error:  # optional: the run goes on without this file
            logger.warning("could not write the profile %s: %r", url, error)
            return []
        return [url]


def _start(settings: ProfileSettings, roles: list[str]):
    """Start the tool; the handle :func:`_stop` needs."""
    if settings.tool == "torch_memory":
        if not torch.cuda.is_available():
            raise RuntimeError("global_profiler.tool=torch_memory records CUDA allocations; this process has no GPU")
        torch.cuda.memory._record_memory_history(**settings.memory)
        return None
    contents = {item for role in roles for item in settings.roles[role].tool_config.torch.contents} or set(
        TORCH_CONTENTS
    )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if "cuda" in contents and torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        record_shapes="shapes" in contents,
        profile_memory="memory" in contents,
        with_stack="stack" in contents,
    )
    profiler.start()
    return profiler


def _stop(settings: ProfileSettings, recorder) -> bytes:
    """Stop the tool and return the file's bytes: a gzipped Chrome trace, or the pickled memory snapshot."""
    if settings.tool == "torch_memory":
        try:
            return pickle.dumps(torch.cuda.memory._snapshot())
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    recorder.stop()
    with tempfile.TemporaryDirectory(prefix="ppoflow-profile-") as directory:
        trace = os.path.join(directory, "trace.json")
        recorder.export_chrome_trace(trace)
        with open(trace, "rb") as handle:
            return gzip.compress(handle.read(), compresslevel=6)
