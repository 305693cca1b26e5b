"""The ``trainer`` section (with verl's ``trainer.v1``: the trainer mode and the async modes' settings),
``ray``, and each ``skip.<stage>`` cache.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from ppoflow.configs.modes import DEFAULT_MODE, mode_list
from ppoflow.configs.schema_base import PATH_NAME_RULE, PathName, Section

LOGGERS = ("console", "tensorboard", "wandb", "mlflow", "file", "trackio")
MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks")
"""Tracking-URI schemes MLflow's client opens (a plain path is a ``file`` store)."""


class CustomSamplerConfig(Section):
    path: str | None = Field(description="A Python file holding a ReplayBuffer subclass; null = the built-in buffer.")
    name: str | None = Field(description="The class's name in that file.")


class SamplerConfig(Section):
    """verl's ``trainer.v1.sampler``: how the async modes' replay buffer bounds staleness."""

    max_off_policy_threshold: int = Field(
        ge=1,
        description="Largest span (training step - dispatch step + 1) a prompt group may have when it is trained on.",
    )
    max_off_policy_strategy: Literal["drop", "wait"] = Field(
        description="drop: evict finished groups whose span exceeds the threshold and feed as many fresh prompts; "
        "wait: sample only once no pending or running group has reached it."
    )
    custom_sampler: CustomSamplerConfig


class ColocateAsyncConfig(Section):
    num_warmup_batches: int = Field(
        ge=0,
        description="Train batches of prompts fed before the first step (prefetch "
        "depth), besides the one fed at every step.",
    )
    partial_rollout: bool = Field(
        description="A request aborted when the replicas sleep resumes from its partial "
        "output with the new weights (verl's partial rollout); false: it "
        "starts over with them, so no trajectory spans weight versions."
    )


class SeparateAsyncConfig(Section):
    num_warmup_batches: int = Field(ge=0, description="As colocate_async.num_warmup_batches.")
    parameter_sync_step: int = Field(
        ge=1,
        description="Mini-batch updates per training step between weight pushes; "
        "train_batch_size must be this x ppo_mini_batch_size.",
    )


class TrainerV1Config(Section):
    """verl's ``trainer.v1``: the trainer mode and the async modes' settings."""

    trainer_mode: str | None = Field(
        description="Trainer mode, the same setting as trainer.mode (null = trainer.mode's): one of the registered "
        "modes (see trainer.mode)."
    )
    trainer_module: str | None = Field(
        description="A Python file imported before trainer_mode is looked up: "
        "its @register_trainer classes become modes."
    )
    colocate_async: ColocateAsyncConfig
    separate_async: SeparateAsyncConfig
    sampler: SamplerConfig


class TrainerConfig(Section):
    project_name: PathName = Field(
        description=f"Project name; names the run and cache directories, so it is one directory name: {PATH_NAME_RULE}."
    )
    experiment_name: PathName = Field(
        description=f"Experiment name; names the run and cache directories, so it is one "
        f"directory name: {PATH_NAME_RULE}."
    )
    mode: str = Field(
        description=f"Trainer mode: {mode_list()}, or a mode of your own registered with "
        "ppoflow.flows.modes.register_trainer (trainer.v1.trainer_module names its file). The same setting as "
        f"trainer.v1.trainer_mode; null = that one's, or {DEFAULT_MODE}."
    )
    nnodes: int = Field(ge=1, description="Nodes of the training pool (actor, ref, critic).")
    n_gpus_per_node: int = Field(ge=0, description="GPUs per node of the training pool; 0 = CPU.")
    n_cpu_ranks_per_node: int = Field(
        ge=1, description="Training ranks per node when the training pool is on CPUs (trainer.n_gpus_per_node=0)."
    )
    total_epochs: int = Field(
        ge=1, description="Passes over the train set (unless total_training_steps stops earlier)."
    )
    total_training_steps: int | None = Field(ge=1, description="Steps to run; null = total_epochs x steps per epoch.")
    test_freq: int = Field(ge=-1, description="Validate every N steps (and after the last); -1 or 0 = never.")
    save_freq: int = Field(ge=-1, description="Checkpoint every N steps (and after the last); -1 or 0 = never.")
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        description="auto: resume from the newest complete checkpoint in default_local_dir; disable: start fresh; "
        "resume_path: resume from resume_from_path."
    )
    resume_from_path: str | None = Field(description="A global_step_N checkpoint directory (resume_mode=resume_path).")
    val_before_train: bool = Field(description="Validate once before the first step (when test_freq > 0).")
    default_local_dir: str = Field(description="Run directory: metrics.jsonl, TensorBoard events, checkpoints.")
    logger: list[str] = Field(
        description="Where metrics go besides metrics.jsonl: console, tensorboard, wandb, mlflow, file, trackio "
        "(docs/trackers.md). A tracker that fails warns once and the run goes on."
    )
    log_val_generations: int = Field(
        ge=0, description="Validation samples logged per validation to the wandb table / MLflow artifact; 0 = none."
    )
    rollout_data_dir: str | None = Field(
        description="Write each step's trained generations as <step>.jsonl here (any fsspec URL); null = no dump."
    )
    validation_data_dir: str | None = Field(
        description="Write each validation's generations as <step>.jsonl here (any fsspec URL); null = no dump."
    )
    mlflow_tracking_uri: str | None = Field(
        description="MLflow tracking URI (trainer.logger=mlflow); null = env MLFLOW_TRACKING_URI, else verl's "
        "sqlite:////tmp/mlruns.db."
    )
    task_run_tags: bool = Field(
        description="Tag every stage's task run (stage:, kind:, mode:, experiment:) for the Prefect UI's tag filters. "
        "Off by default: Prefect asks its server for tag concurrency slots before each tagged task "
        "run, a database write that stalls the step for seconds on a busy SQLite server "
        "(docs/ui.md). Task-run names carry the stage and step either way."
    )
    nonfinite: Literal["fail", "skip"] = Field(
        description="A non-finite reward, advantage, loss or gradient norm: fail (stop the run, naming the sample, "
        "step and stage where it arose) or skip (drop that step's update with a warning and count it in "
        "training/nonfinite_skipped); a run whose every update was skipped never ends as a success."
    )
    run_dir_busy: Literal["fail", "wait"] = Field(
        description="Another live run owns default_local_dir: fail at start naming the owner, or wait for it to end."
    )
    run_dir_wait_s: float | None = Field(
        gt=0, description="trainer.run_dir_busy=wait: give up after this many seconds; null = wait as long as it takes."
    )
    v1: TrainerV1Config

    @field_validator("logger")
    @classmethod
    def _known_loggers(cls, names: list[str]) -> list[str]:
        """Each name picks a metrics writer; refused here, with the other keys, rather than ignored."""
        unknown = [name for name in names if name not in LOGGERS]
        if unknown:
            raise PydanticCustomError(
                "unknown_logger",
                "unknown logger {unknown}; choose from {choices}",
                {"unknown": ", ".join(map(repr, unknown)), "choices": ", ".join(LOGGERS)},
            )
        return names

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _readable_uri(cls, uri: str | None) -> str | None:
        """A URI MLflow cannot open is refused before anything starts, not found out at the first step."""
        scheme = uri.split("://", 1)[0].split("+", 1)[0] if uri and "://" in uri else None
        if uri is not None and (not uri.strip() or (scheme is not None and scheme not in MLFLOW_SCHEMES)):
            raise PydanticCustomError(
                "unreadable_uri",
                "{uri!r} is no MLflow tracking URI; use a path or a URI with one of {schemes}",
                {"uri": uri, "schemes": ", ".join(MLFLOW_SCHEMES)},
            )
        return uri


class RayConfig(Section):
    address: str | None = Field(
        description="Ray cluster to join (or env RAY_ADDRESS); null = start a local Ray inside the run."
    )
    num_cpus: int | None = Field(
        ge=1, description="CPUs of the local Ray (a whole number, as ray.init takes); null = enough for every role."
    )
    worker_niceness: int = Field(
        ge=0,
        le=19,
        description="Niceness of the local Ray's worker processes, which hold the models: 0 = the driver's priority "
        "(Ray's own default, 15, makes the model yield to everything else on the machine; docs/benchmarks.md). "
        "A cluster joined through `address` keeps its own setting.",
    )
    worker_allocator: Literal["jemalloc", "system"] = Field(
        description="Memory allocator of the local Ray's worker processes: jemalloc = the build Ray ships (and "
        "runs its own GCS and raylet with), keeping freed pages for reuse and handing them back at each stage's "
        "end (a faster update with a lower peak than glibc's malloc; docs/architecture.md#memory); system = the C "
        "library's malloc. An LD_PRELOAD or MALLOC_CONF of the driver's wins; a cluster joined through `address` "
        "keeps its own.",
    )


class SkipStageConfig(Section):
    """verl's SkipManager role config: cache (or repeat) a stage's result per training step. Every
    ``skip.<stage>`` section takes its defaults from ``skip.rollout`` in ``ppo_trainer.yaml``."""

    enable: bool = Field(description="Turn caching of this stage on.")
    dump_dir: str = Field(description="Cache root, any fsspec URL (`~` expanded).")
    steps: list[Annotated[int, Field(ge=1)]] = Field(
        description="Training steps (from 1) whose result may be loaded or dumped (for skip.async_rollout: feed "
        "indexes of prompts, from 1)."
    )
    action: Literal["cache", "repeat"] = Field(
        description="cache = this step's own dump; repeat = the nearest dumped step."
    )
    storage_options: dict = Field(description="fsspec options (endpoint; never credentials) for dump_dir.")
    allow_mismatch: bool = Field(
        description="Replay entries recorded with other sampling settings, model or tokenizer "
        "(a deliberate cross-config replay); the differences are still logged."
    )
    timeout_s: float = Field(
        gt=0,
        description="A storage call that takes longer is abandoned (the stage is computed "
        "instead, with a warning); a stall is reported while it lasts.",
    )
    retries: int = Field(ge=0, description="Retries of a failed cache write (with backoff) before it is given up.")
