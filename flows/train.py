"""The PPO/GRPO training flow.

One step is the algorithm stage by stage (``tasks/`` declares each stage once): 1 generate, 2 reward, 3 the forward
passes (``old_log_prob``, ``ref_log_prob``, ``values``, submitted together), 4 advantage, 5 update, 6 weight_sync.
Stages 2-5 are :func:`ppo_update`; when 1 and 6 happen is the trainer mode's business (:mod:`ppoflow.flows.modes`).
Every stage is a Prefect task whose heavy work runs in a long-lived Ray actor; :func:`train` runs the same steps
without Prefect or Ray when asked (the overhead benchmark's baseline). A non-finite value fails the run or drops the
step's update (``trainer.nonfinite``). Details: docs/architecture.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from operator import attrgetter
from pathlib import Path
from typing import Annotated, Literal, get_args

from prefect import flow, get_run_logger
from prefect import tags as prefect_tags
from prefect.context import TagsContext
from prefect.runtime import flow_run as prefect_flow_run
from pydantic import Field

from ppoflow.algorithms.correction import correct_off_policy
from ppoflow.algorithms.finite import NonFiniteError, describe_rows, nonfinite_rows
from ppoflow.algorithms.user_code import import_module
from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.schema import PATH_NAME_PATTERN, PPOConfig
from ppoflow.configs.stages import STAGE_NAMES
from ppoflow.flows import (
    async_modes,  # noqa: F401 - registers colocate_async and separate_async
    cancellation,
)
from ppoflow.flows.artifacts import RunArtifacts
from ppoflow.flows.cache_report import report_caches
from ppoflow.flows.checkpointing import restore_newest, save_checkpoint
from ppoflow.flows.logs import logs_to_prefect, note
from ppoflow.flows.metrics import aggregate_updates, data_metrics
from ppoflow.flows.modes import TRAINER_MODES, TrainerMode, make_trainer
from ppoflow.flows.ownership import own_run_directory
from ppoflow.flows.run import RunContext, start_run
from ppoflow.flows.stages import StepData
from ppoflow.flows.state import TrainerState
from ppoflow.flows.tracking import Tracker, read_metrics
from ppoflow.flows.validation import validate, validation_line
from ppoflow.storage.batch import concatenate, non_tensor_column
from ppoflow.storage.checkpoint import exported_model_url, latest
from ppoflow.storage.replay_buffer import load_sampler

logger = logging.getLogger(__name__)


def ppo_update(run: RunContext, state: TrainerState, step: StepData) -> bool:
    """Stages 2-5 on the step's generated batch: reward, log-probs, advantage, critic and actor updates.
    Returns whether the update was made: a non-finite reward, advantage, loss or gradient fails the run
    (``trainer.nonfinite=fail``) or drops the update (``skip``, :func:`drop_update`)."""
    kl_controller = state.kl_controller.state_dict()
    try:
        ppo_stages(run, state, step)
    except NonFiniteError as error:
        reason = str(getattr(error, "cause", error))  # a worker's error comes wrapped by Ray (RayTaskError)
        if run.cfg.trainer.nonfinite == "fail":
            raise NonFiniteError(f"{reason} (trainer.nonfinite=fail; =skip drops such a step's update)") from None
        state.kl_controller.load_state_dict(kl_controller)  # the advantage stage may have moved it
        drop_update(run, step, reason)
        return False
    step.metrics["training/nonfinite_skipped"] = 0.0
    return True


def ppo_stages(run: RunContext, state: TrainerState, step: StepData) -> None:
    """Stages 2-5, raising :class:`NonFiniteError` where a reward or advantage is not finite, or where the
    actor took no optimizer step (a loss or gradient: the update's worker skips or raises, per mini-batch)."""
    cfg, stages, batch = run.cfg, run.stages, step.batch
    correction = cfg.algorithm.rollout_correction
    # 2. reward: score each response, on its last token (a rollout that streams the reward has scored each
    #    trajectory as it finished)
    if "token_level_scores" not in batch.keys():
        stages.call("reward", step, batch, run.tokenizer, run.custom_scorer, run.reward_chunks)
    check_finite(step, "reward", "token_level_scores")
    # 3. log-probs of the pre-update policy (bypass mode: the rollout's own; an on-policy update: its own,
    #    in stage 5), reference log-probs, values; the batch is placed once for the passes that run
    recompute_old = not correction.bypass_mode and not cfg.old_log_probs_from_update
    if correction.bypass_mode:
        batch["old_log_probs"] = batch["rollout_log_probs"]
    shared = run.share(batch) if recompute_old or cfg.use_reference or cfg.use_critic else None
    passes = {}  # independent forward passes on their own workers: submitted together, computed side by side
    if recompute_old:  # a step's later rounds (separate_async) keep the step's first π_old: decoupled PPO
        passes["old_log_prob"] = (run.workers, shared, step.round > 0)
    if cfg.use_reference:
        passes["ref_log_prob"] = (run.workers, shared)
    if cfg.use_critic:
        passes["values"] = (run.workers, shared)
    stages.call_together(step, passes)
    if recompute_old:
        correct_for_the_rollout(step, correction)  # verl's decoupled correction of the sampling policy's lag
    # 4. advantage: token rewards (scores minus an optional KL penalty), then the estimator
    stages.call("advantage", step, batch, cfg.algorithm, state.kl_controller)
    check_finite(step, "advantage", "advantages", "returns")
    # 5. update the critic, then the actor
    shared = run.share(batch)
    if cfg.use_critic:
        stages.call("update_critic", step, run.workers, shared, step.step)
    stages.call("update_actor", step, run.workers, shared, step.step)
    if not step.metrics["actor/optimizer_steps"]:  # trainer.nonfinite=skip skipped each (the actor warned which)
        raise NonFiniteError(
            f"step {step.step} update_actor: every optimizer step was skipped on a non-finite loss or gradient norm"
        )
    if cfg.old_log_probs_from_update:  # the update returned its old log-probs: how far was the rollout from them
        correct_for_the_rollout(step, correction)
        step.metrics["training/old_log_prob_skipped"] = 1.0
    step.metrics.update(data_metrics(batch))


def check_finite(step: StepData, stage: str, *fields: str) -> None:
    """:class:`NonFiniteError` naming the samples (row, uid, data source, value) where one of the batch's
    ``fields`` is NaN or infinite after ``stage``."""
    batch = step.batch
    for name in fields:
        found = nonfinite_rows(batch[name])
        if found:
            columns = {column: non_tensor_column(batch, column) for column in ("uid", "data_source")}
            what = "reward" if stage == "reward" else name
            raise NonFiniteError(f"step {step.step} {stage}: {describe_rows(what, found, len(batch), columns)}")


def drop_update(run: RunContext, step: StepData, reason: str) -> None:
    """``trainer.nonfinite=skip``: the step's update is dropped - no actor optimizer step from its values, the
    actor's unchanged weights take the step's version - with a warning, counted in ``training/nonfinite_skipped``."""
    logger.warning("%s; step %d's update is dropped (trainer.nonfinite=skip)", reason, step.step)
    run.workers.get(run.workers.actor.submit("skip_update"))
    step.metrics["training/nonfinite_skipped"] = 1.0


def correct_for_the_rollout(step: StepData, correction) -> None:
    """Reject and/or importance-weight trajectories by how far the rollout's sampling log-probs are from
    the trainer's old log-probs (``algorithm.rollout_correction``); the math is in ``algorithms.correction``."""
    batch = step.batch
    batch["response_mask"], is_weights, metrics = correct_off_policy(
        batch["old_log_probs"],
        batch["rollout_log_probs"],
        batch["response_mask"],
        rollout_rs=correction.rollout_rs,
        rollout_rs_threshold=correction.rollout_rs_threshold,
        rollout_is=correction.rollout_is,
        rollout_is_threshold=correction.rollout_is_threshold,
        rollout_is_batch_normalize=correction.rollout_is_batch_normalize,
    )
    if is_weights is not None:
        batch["rollout_is_weights"] = is_weights
    step.metrics.update(metrics)


def train_steps(run: RunContext, state: TrainerState, mode: TrainerMode, steps: range) -> Iterator[StepData]:
    """The training loop over ``steps``: the mode's hooks around stage 1 and the PPO update; yields each
    finished step (validation, logging and checkpointing happen in the caller, between steps)."""
    mode.on_train_begin(steps)
    for number in steps:
        step = StepData(number)
        with step.timed("step"):
            mode.on_step_begin(step)
            updates, made = [], []
            for round_ in range(mode.updates_per_step):  # one, but separate_async's parameter_sync_step
                update = StepData(number, round=round_)
                mode.on_sample_begin(update)
                with update.timed(STAGE_NAMES["generate"].timing):
                    mode.sample(update)  # 1. generate (the async modes: sample the replay buffer)
                mode.on_sample_end(update)
                if ppo_update(run, state, update):  # 2.-5.
                    made.append(update)
                updates.append(update)
            trained = made or updates  # the samples the step trained on (every update dropped: those it drew)
            if len(updates) == 1:
                step.batch = updates[0].batch
                step.metrics.update(updates[0].metrics)
            else:  # the step trained on every round's samples
                step.batch = concatenate(*(update.batch for update in trained), pad_token_id=run.tokenizer.pad_token_id)
                step.metrics.update(aggregate_updates([update.metrics for update in updates]))
            state.weight_version += 1  # the weights of this step's update(s), the version the next push carries
            mode.on_step_end(step)  # (sync: 6. push the new weights)
        step.metrics.update({"training/global_step": number, "training/epoch": state.finish_step(number)})
        yield step
    mode.on_train_end()


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
    tracker = None
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
        tracker = Tracker(cfg.trainer.default_local_dir, cfg.trainer.logger, run.total_steps, first_step=first_step)
        artifacts = RunArtifacts(cfg, run.total_steps, first_step=first_step)
        if resume:
            note(f"resumed from {resume}: continuing at step {first_step}")
        test_freq = cfg.trainer.test_freq if run.val_set is not None else 0
        save_freq = cfg.trainer.save_freq
        if test_freq > 0 and cfg.trainer.val_before_train and first_step == 1:
            val_metrics, samples = validate(run, step=0)
            artifacts.validated_before_training(val_metrics)
            note(validation_line(0, val_metrics, samples))
        steps, dropped = range(first_step, run.total_steps + 1), 0
        for step in train_steps(run, state, mode, steps):
            dropped += step.metrics["training/nonfinite_skipped"] == mode.updates_per_step
            last = step.step == run.total_steps
            if test_freq > 0 and (step.step % test_freq == 0 or last):
                mode.on_validate_begin(step.step)
                val_metrics, samples = validate(run, step.step)
                mode.on_validate_end(step.step)
                step.metrics.update(val_metrics)
                note(validation_line(step.step, val_metrics, samples))
            tracker.log(step.step, step.metrics)
            artifacts.step(step.step, step.metrics, step.batch)
            if save_freq > 0 and (step.step % save_freq == 0 or last):
                directory = save_checkpoint(
                    cfg, run.workers, step.step, {"trainer": state.state_dict(), "mode": mode.state_dict()}
                )
                note(f"checkpoint written to {directory}")
        if steps and dropped == len(steps):
            raise NonFiniteError(
                f"every update of the run was dropped on non-finite values ({dropped} of {dropped} "
                f"steps, trainer.nonfinite=skip): the policy is the one it started from"
            )
        final_model = exported_model_url(cfg.trainer.default_local_dir, run.total_steps)
        run.workers.get(run.workers.actor.submit("save_pretrained", final_model))
        note(f"trained policy written to {final_model}")
        cache_lines = report_caches(run.stages.caches, cfg)  # what each step cache replayed of its planned steps
        run_dir = cfg.trainer.default_local_dir
        curve = artifacts.finish(
            read_metrics(run_dir),
            checkpoint=latest(run_dir),
            final_model=final_model,
            caches=[cache.entries.root for cache in run.stages.caches.values()],
            cache_lines=cache_lines,
        )
        note(f"reward curve written to {curve}")
    finally:
        if tracker is not None:
            tracker.close()
        run.workers.shutdown()
    return step.metrics


def check_mode(cfg: PPOConfig) -> None:
    """``trainer.mode`` names a registered trainer mode (after importing ``trainer.v1.trainer_module``, whose
    modes register themselves) and ``trainer.v1.sampler.custom_sampler`` a replay buffer, or
    :class:`ConfigError` (before anything starts)."""
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


FORM_FIELDS = {
    "experiment_name": "trainer.experiment_name",
    "total_training_steps": "trainer.total_training_steps",
    "mode": "trainer.mode",
}
"""The typed fields of :func:`ppo_train` and the config key each one sets."""


BuiltInMode = Literal["sync", "one_step_off", "colocate_async", "separate_async"]
"""The modes the flow's ``mode`` field offers; a mode of the user's (``trainer.v1.trainer_module``) is set by an
override instead."""


def typed_fields(cfg: PPOConfig) -> dict:
    """The values :data:`FORM_FIELDS` take in ``cfg`` (those that are set, and a mode only if it is built in)."""
    values = {name: attrgetter(key)(cfg) for name, key in FORM_FIELDS.items()}
    if values["mode"] not in get_args(BuiltInMode):
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
    mode: BuiltInMode | None = None,
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
        mode: trainer.mode: sync, one_step_off (generation overlaps the update), or verl's V1 colocate_async or
            separate_async (a replay buffer; they need actor_rollout_ref.rollout.mode=async); blank: the config's.
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
