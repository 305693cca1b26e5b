"""verl's profiler keys: ``global_profiler`` (which steps, which tool, where the files go) and each role's
``profiler`` (whether it is profiled, on which ranks, what the torch profiler records). Details: docs/trackers.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ppoflow.configs.schema_base import Section

TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")


class TorchToolConfig(Section):
    contents: list[Literal[TORCH_CONTENTS]] = Field(  # type: ignore[valid-type]
        description="What the torch profiler records: cpu, cuda, memory, shapes, stack; [] = all of them (verl's "
        "default). CPU activity is always recorded: the stages' record_function ranges are CPU events."
    )


class RoleToolConfig(Section):
    torch: TorchToolConfig


class ProfilerConfig(Section):
    """One role's ``profiler`` (actor, ref, rollout, critic)."""

    enable: bool = Field(description="Profile this role's processes at global_profiler.steps.")
    all_ranks: bool = Field(description="Profile every data-parallel rank of the role.")
    ranks: list[Annotated[int, Field(ge=0)]] = Field(description="The ranks to profile unless all_ranks; [] = rank 0.")
    tool_config: RoleToolConfig


class TorchMemoryConfig(Section):
    trace_alloc_max_entries: int = Field(ge=1, description="torch_memory: allocations the CUDA snapshot keeps.")
    context: Literal["state", "alloc", "all"] | None = Field(
        description="torch_memory: which events record a stack (torch's _record_memory_history context)."
    )
    stacks: Literal["all", "python"] = Field(description="torch_memory: python or python + C++ stacks.")


class GlobalToolConfig(Section):
    torch_memory: TorchMemoryConfig


class GlobalProfilerConfig(Section):
    """verl's ``global_profiler``: the steps and the tool every enabled role's profiler uses."""

    tool: Literal["torch", "torch_memory"] | None = Field(
        description="torch: a Chrome trace per profiled process and step (torch.profiler, CPU and GPU); "
        "torch_memory: a CUDA memory snapshot (GPU roles only); null = no profiling."
    )
    steps: list[Annotated[int, Field(ge=1)]] | None = Field(
        description="Training steps to profile (from 1); null = none."
    )
    save_path: str | None = Field(
        description="Where traces go: step<N>/<role>_rank<r>.json.gz under it (any fsspec URL); null = "
        "<trainer.default_local_dir>/profile."
    )
    global_tool_config: GlobalToolConfig
