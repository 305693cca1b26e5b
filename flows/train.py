"""The PPO/GRPO training flow: a run of training steps (:mod:`ppoflow.flows.step`), with validation, logging,
checkpoints and resume between them.

Every stage is a Prefect task whose heavy work runs in a long-lived Ray actor; :func:`train` runs the same steps
without Prefect or Ray when asked (the overhead benchmark's baseline). :func:`ppo_train` is the flow people start
from the CLI, a deployment or the Prefect UI, its typed fields derived from the config schema and the registered
trainer modes. Details: docs/architecture.md.
"""

from __future__ import annotations

import logging
import random
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect import tags as prefect_tags
from prefect.context import TagsContext
from prefect.runtime import flow_run as prefect_flow_run
from pydantic import Field, GetPydanticSchema

from ppoflow.algorithms.finite import NonFiniteError
from ppoflow.algorithms.user_code import import_module
from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.modes import mode_errors
from ppoflow.configs.schema import PATH_NAME_PATTERN, PPOConfig
from ppoflow.flows import (
    async_modes,  # noqa: F401 - registers the streaming modes
    cancellation,
)
from ppoflow.flows.artifacts import RunArtifacts
from ppoflow.flows.async_modes import load_sampler
from ppoflow.flows.cache_report import report_caches
from ppoflow.flows.checkpointing import restore_newest, save_checkpoint
from ppoflow.flows.dumps import GenerationDumper, generation_rows
from ppoflow.flows.logs import logs_to_prefect, note
from ppoflow.flows.modes import TRAINER_MODES, make_trainer
from ppoflow.flows.ownership import own_run_directory
from ppoflow.flows.profiling import profile_links
from ppoflow.flows.run import start_run
from ppoflow.flows.stages import StepData
from ppoflow.flows.state import TrainerState
from ppoflow.flows.step import train_steps
from ppoflow.flows.tracking import Tracker, read_metrics
from ppoflow.flows.validation import validate, validation_line
from ppoflow.storage.checkpoint import exported_model_url, latest
from ppoflow.storage.fs import open_fs

logger = logging.getLogger(__name__)


def train(cfg: PPOConfig, *, orchestrated: bool = True) -> dict[str, float]:
    """Run the whole training loop (resuming from a checkpoint when there is one); returns the last step's metrics."""
    check_mode(cfg)
    with own_run_directory(cfg):  # one run at a time in a run directory
        return _train(cfg, orchestrated)


def _train(cfg: PPOConfig, orchestrated: bool) -> dict[str, float]:
    run = start_run(cfg, orchestrated=orchestrated)
    state = TrainerState(cfg, len(run.train_set))
    mode = make_trainer(run, state)
    step = StepData(0)
    tracker = dumper = None
    try:
        restored = restore_newest(cfg, run.workers)  # the newest checkpoint that loads, per trainer.resume_mode
        resume = restored.directory if restored else None
        first_step = 1
        if restored:
            state.load_state_dict(restored.parts["trainer"])
            mode.load_state_dict(restored.parts["mode"])
            first_step = restored.step + 1
            mode.push_weights()  # the rollout worker serves the restored weights
        mode.on_init_end()
        tracker = Tracker(
            cfg.trainer.default_local_dir,
            cfg.trainer.logger,
            run.total_steps,
            first_step=first_step,
            cfg=cfg,
            resume_ids=restored.parts.get("trackers") if restored else None,
        )
        dumper = GenerationDumper(run.tokenizer)
        artifacts = RunArtifacts(cfg, run.total_steps, first_step=first_step)
        if resume:
            note(f"resumed from {resume}: continuing at step {first_step}")
        test_freq = cfg.trainer.test_freq if run.val_set is not None else 0
        save_freq = cfg.trainer.save_freq
        if test_freq > 0 and cfg.trainer.val_before_train and first_step == 1:
            val_metrics, samples = validate_and_dump(run, 0, tracker, dumper)
            artifacts.validated_before_training(val_metrics)
            note(validation_line(0, val_metrics, samples))
        steps, dropped = range(first_step, run.total_steps + 1), 0
        for step in train_steps(run, state, mode, steps):
            dropped += step.metrics["training/nonfinite_skipped"] == mode.updates_per_step
            last = step.step == run.total_steps
            if test_freq > 0 and (step.step % test_freq == 0 or last):
                mode.on_validate_begin(step.step)
                val_metrics, samples = validate_and_dump(run, step.step, tracker, dumper)
                mode.on_validate_end(step.step)
                step.metrics.update(val_metrics)
                note(validation_line(step.step, val_metrics, samples))
            if cfg.trainer.rollout_data_dir or cfg.trainer.validation_data_dir:
                dumper.dump(cfg.trainer.rollout_data_dir, step.step, batch=step.batch)
                step.metrics.update(dumper.metrics())
            tracker.log(step.step, step.metrics)
            artifacts.step(step.step, step.metrics, step.batch)
            if save_freq > 0 and (step.step % save_freq == 0 or last):
                directory = save_checkpoint(
                    cfg,
                    run.workers,
                    step.step,
                    {"trainer": state.state_dict(), "mode": mode.state_dict(), "trackers": tracker.state_dict()},
                )
                note(f"checkpoint written to {directory}")
        if steps and dropped == len(steps):
            raise NonFiniteError(
                f"every update of the run was dropped on non-finite values ({dropped} of {dropped} "
                f"steps, trainer.nonfinite=skip): the policy is the one it started from"
            )
        final_model = exported_model_url(cfg.trainer.default_local_dir, run.total_steps)
        run.workers.actor.save_pretrained(final_model)
        note(f"trained policy written to {final_model}")
        cache_lines = report_caches(run.stages.caches, cfg)  # what each step cache replayed of its planned steps
        run_dir = cfg.trainer.default_local_dir
        curve = artifacts.finish(
            read_metrics(run_dir),
            checkpoint=latest(run_dir),
            final_model=final_model,
            caches=[cache.entries.root for cache in run.stages.caches.values()],
            cache_lines=cache_lines,
            links=tracker.links() + dump_links(cfg) + profile_links(cfg),
        )
        fs, path = open_fs(curve)
        tracker.log_file("reward_curve.png", fs.cat_file(path))
        note(f"reward curve written to {curve}")
    finally:
        if dumper is not None:
            dumper.close()
        if tracker is not None:
            tracker.close()
        run.workers.shutdown()
    return step.metrics


def validate_and_dump(run, step: int, tracker: Tracker, dumper: GenerationDumper) -> tuple[dict[str, float], list[str]]:
    """:func:`validate`, its generations dumped to ``trainer.validation_data_dir`` and ``trainer.log_val_generations``
    of them (verl's pick: sorted by input, shuffled with seed 42) logged to the trackers' tables."""
    trainer = run.cfg.trainer
    if not (trainer.validation_data_dir or trainer.log_val_generations):
        return validate(run, step)
    rows: list[dict] = []
    metrics, samples = validate(
        run, step, rows_of=lambda batch: rows.extend(generation_rows(batch, run.tokenizer, step))
    )
    dumper.dump(trainer.validation_data_dir, step, rows=rows)
    if trainer.log_val_generations:
        picked = sorted(
            ({key: row[key] for key in ("input", "output", "score")} for row in rows), key=lambda r: r["input"]
        )
        random.Random(42).shuffle(picked)
        tracker.log_table(step, picked[: trainer.log_val_generations])
    return metrics, samples


def dump_links(cfg: PPOConfig) -> list[tuple[str, str]]:
    """The summary's rows for the generation dumps."""
    trainer = cfg.trainer
    dirs = (("rollout dumps", trainer.rollout_data_dir), ("validation dumps", trainer.validation_data_dir))
    return [(label, where) for label, where in dirs if where]


def check_mode(cfg: PPOConfig) -> None:
    """``trainer.mode`` names a registered trainer mode (after importing ``trainer.v1.trainer_module``, whose
    modes register themselves) and the config gives what it needs (:func:`~ppoflow.configs.modes.mode_errors`),
    and ``trainer.v1.sampler.custom_sampler`` names a replay buffer, or :class:`ConfigError` (before anything
    starts)."""
    v1 = cfg.trainer.v1
    if v1.trainer_module is not None:
        try:
            import_module(v1.trainer_module)
        except ValueError as error:
            raise ConfigError([("trainer.v1.trainer_module", str(error))]) from None
    try:
        load_sampler(v1.sampler.custom_sampler.path, v1.sampler.custom_sampler.name)
    except ValueError as error:
        raise ConfigError([("trainer.v1.sampler.custom_sampler", str(error))]) from None
    if cfg.trainer.mode not in TRAINER_MODES:
        raise ConfigError(
            [("trainer.mode", f"{cfg.trainer.mode!r} is not a trainer mode; registered: {', '.join(TRAINER_MODES)}")]
        )
    problems = mode_errors(cfg)  # a mode from trainer_module is known to the config's rules only now
    if problems:
        raise ConfigError(problems)


FORM_FIELDS = {
    "experiment_name": "trainer.experiment_name",
    "total_training_steps": "trainer.total_training_steps",
    "mode": "trainer.mode",
}
"""The typed fields of :func:`ppo_train` and the config key each one sets."""


def _registered_modes(schema, handler) -> dict:
    """The JSON schema of a mode name: a string, one of the modes registered when the schema is made."""
    return {**handler(schema), "enum": list(TRAINER_MODES)}


RegisteredMode = Annotated[str, GetPydanticSchema(get_pydantic_json_schema=_registered_modes)]
"""The flow's ``mode`` field: any name (:func:`check_mode` refuses an unknown one, naming the registered ones),
offered in the parameter schema - the UI form's dropdown - as the modes registered when a deployment is built
(``ppoflow serve`` imports its config's ``trainer.v1.trainer_module`` first)."""


def typed_fields(cfg: PPOConfig) -> dict:
    """The values :data:`FORM_FIELDS` take in ``cfg`` (those that are set, and a mode only if it is registered)."""
    values = {name: attrgetter(key)(cfg) for name, key in FORM_FIELDS.items()}
    if values["mode"] not in TRAINER_MODES:
        values["mode"] = None
    return {name: value for name, value in values.items() if value is not None}


def flow_run_name() -> str:
    """``<experiment>-<UTC time>``, e.g. ``grpo_tiny-20261203-014500``: the runs list tells experiments apart.
    The experiment is the typed field, else the config's (else, for a config that does not load, the preset:
    the run then fails at once, naming the key)."""
    parameters = prefect_flow_run.parameters
    experiment = parameters.get("experiment_name")
    if not experiment:
        try:
            cfg = load_config(parameters.get("config"), parameters.get("overrides", []))
            experiment = cfg.trainer.experiment_name
        except ConfigError:
            experiment = preset_tag(parameters.get("config"))
    return f"{experiment}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


def preset_tag(config: str | None) -> str:
    """The preset's name, or a YAML file's stem."""
    config = config or "grpo_tiny"
    return Path(config).stem if config.endswith((".yaml", ".yml")) else config


@flow(name="ppo-train", log_prints=True, flow_run_name=flow_run_name)
def ppo_train(
    config: str = "grpo_tiny",
    overrides: list[str] = [],  # noqa: B006 - a plain list default keeps the parameter optional in Prefect's schema
    experiment_name: Annotated[str, Field(pattern=PATH_NAME_PATTERN)] | None = None,
    total_training_steps: Annotated[int | None, Field(ge=1)] = None,
    mode: RegisteredMode | None = None,
) -> dict[str, float]:
    """Train a policy with PPO/GRPO.

    The run's config is the preset (or YAML file) with the overrides merged over it; the typed
    fields, when set, are applied last. An invalid config fails the run at once, naming the key. A
    served deployment fills the typed fields with its preset's values (``ppoflow serve --config``), so
    its form shows what a run will use.

    Args:
        config: Preset in configs/ (grpo_tiny, vault_tool, ppo_trainer) or a path to a YAML file.
        overrides: key=value overrides, one per row, e.g. actor_rollout_ref.rollout.n=4 or skip.rollout.steps=[1,2].
        experiment_name: trainer.experiment_name (names the run and cache directories); blank: the config's.
        total_training_steps: trainer.total_training_steps; blank: the config's.
        mode: trainer.mode, one of the registered trainer modes (a mode of your own once the config's
            trainer.v1.trainer_module is imported); blank: the config's.
    """
    typed = {"experiment_name": experiment_name, "total_training_steps": total_training_steps, "mode": mode}
    # a name is quoted so that it stays a string ("123" is a name, not a number)
    cfg = load_config(
        config,
        [
            *overrides,
            *(
                f"{FORM_FIELDS[name]}='{value}'" if isinstance(value, str) else f"{FORM_FIELDS[name]}={value}"
                for name, value in typed.items()
                if value is not None
            ),
        ],
    )
    get_run_logger().info("run directory %s", cfg.trainer.default_local_dir)
    tag_flow_run(run_tags(config, cfg))
    cancellation.watch(prefect_flow_run.id)
    # the caller's tags are the flow run's: a tagged task run costs the server a request (trainer.task_run_tags)
    with logs_to_prefect(), TagsContext(current_tags=set()):
        return train(cfg)


def run_tags(config: str | None, cfg: PPOConfig) -> list[str]:
    """The tags that tell a run apart in the runs list: ``experiment:``, ``preset:`` and ``mode:``."""
    trainer = cfg.trainer
    return [f"experiment:{trainer.experiment_name}", f"preset:{preset_tag(config)}", f"mode:{trainer.mode}"]


def tag_flow_run(tags: list[str]) -> None:
    """Add ``tags`` to the current flow run if it was created without them (a run from a deployment or the
    UI's form: :func:`run_ppo_train` creates its runs tagged): one request to the server, a warning if it fails."""
    missing = set(tags) - set(prefect_flow_run.tags)
    if not missing or prefect_flow_run.id is None:
        return
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run(prefect_flow_run.id, tags=sorted(set(prefect_flow_run.tags) | missing))
    except Exception as error:  # the run goes on untagged
        logger.warning("could not tag the flow run %s: %r", prefect_flow_run.id, error)


def run_ppo_train(config: str, overrides: list[str], cfg: PPOConfig, *tags: str, return_state: bool = False):
    """Call :func:`ppo_train` on ``config`` + ``overrides`` (``cfg``, as loaded from them) so that its flow run
    tells what it is: the Parameters show the effective typed fields, and the run is created tagged
    :func:`run_tags` and ``tags`` (``record``, ``replay``) - no request of its own."""
    with prefect_tags(*run_tags(config, cfg), *tags):
        return ppo_train(config=config, overrides=list(overrides), **typed_fields(cfg), return_state=return_state)
