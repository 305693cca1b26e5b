"""The PPO/GRPO training flow.

One step, read top to bottom in :func:`train_steps` and :func:`ppo_update`, is the algorithm::

    1. generate      sample rollout.n responses per prompt            (rollout worker)
    2. reward        score each response, on its last token           (driver)
    3. old_log_prob  log-probs of the pre-update policy               (actor worker)
       ref_log_prob  log-probs of the reference policy, for KL terms  (ref worker, when needed)
       values        V(s_t) for GAE                                   (critic worker, when needed)
    4. advantage     KL-penalised rewards, then the advantage estimator (driver)
    5. update        critic, then actor: PPO epochs over mini-batches (critic / actor workers)
    6. weight_sync   the rollout worker takes the new actor weights

(one_step_off moves 6. and the next step's 1. before 2.-5., so generation overlaps training.)
Every stage is a Prefect task (``tasks/``) whose heavy work runs in a long-lived Ray actor
(``workers/``). :func:`train` runs the same steps without Prefect or Ray when asked (the overhead
benchmark's baseline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Optional

from prefect import flow, get_run_logger
from prefect.settings import get_current_settings
from pydantic import Field
from tensordict import TensorDict

from ppoflow.configs import load_config
from ppoflow.configs.schema import PPOConfig
from ppoflow.flows.artifacts import RunArtifacts
from ppoflow.flows.checkpointing import restore, resume_point, save_checkpoint
from ppoflow.flows.metrics import data_metrics
from ppoflow.flows.stages import PendingStage, StageResult, start_stage
from ppoflow.flows.tracking import Tracker, read_metrics
from ppoflow.storage.batch import NON_TENSOR_FIELDS, non_tensor_column
from ppoflow.storage.checkpoint import latest
from ppoflow.data.datasets import PromptDataset, PromptLoader, ensure_datasets, load_prompt_dataset
from ppoflow.tasks.advantage import advantage
from ppoflow.algorithms.correction import compute_rejection_mask, compute_rollout_is_weights
from ppoflow.algorithms.kl import make_kl_controller
from ppoflow.algorithms.scoring import Scorer, load_custom_scorer, scorer_for
from ppoflow.tasks.caching import StageCache, fingerprint, stage_caches
from ppoflow.tasks.generate import generate
from ppoflow.tasks.log_prob import old_log_prob, ref_log_prob
from ppoflow.tasks.reward import decode_responses, reward
from ppoflow.tasks.update import update_actor, update_critic
from ppoflow.tasks.values import values
from ppoflow.tasks.weight_sync import weight_sync
from ppoflow.workers.group import Workers, start_local_workers, start_workers
from ppoflow.workers.models import check_context_length, ensure_model, load_tokenizer
from ppoflow.workers.rollout import SamplingParams


STAGES = SimpleNamespace(generate=generate, reward=reward, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob,
                         values=values, advantage=advantage, update_critic=update_critic,
                         update_actor=update_actor, weight_sync=weight_sync)
"""The stage tasks a step calls; each call is a Prefect task run."""

BARE_STAGES = SimpleNamespace(**{name: stage.fn for name, stage in vars(STAGES).items()})
"""The same stages as plain functions: a step without any Prefect task run (benchmark baseline)."""


logger = logging.getLogger(__name__)

CACHE_STAGE = {"generate": "rollout", "reward": "reward", "old_log_prob": "old_log_prob", "ref_log_prob": "ref",
               "values": "values", "advantage": "advantage"}
"""The ``skip.<stage>`` key that caches each stage task's result."""

WEIGHTS_OF = {"old_log_prob": "actor", "ref_log_prob": "ref", "values": "critic"}
"""The worker whose weights a stage's result depends on (part of its cache fingerprint)."""


@dataclass
class Run:
    """Everything the steps of one run share, built once by :func:`start_run`."""

    cfg: PPOConfig
    tokenizer: Any
    train_set: PromptDataset
    val_set: PromptDataset | None
    loader: PromptLoader
    total_steps: int
    custom_scorer: Scorer | None
    kl_controller: Any
    workers: Workers
    stages: Any
    sampling: SamplingParams
    caches: dict[str, StageCache]
    reward_chunks: int = 0
    batches: Optional[Iterator[tuple[int, list[int]]]] = None
    epochs: dict[int, int] = field(default_factory=dict)
    step_prompts: dict[int, TensorDict] = field(default_factory=dict)
    synced_version: int = 0
    launch_versions: dict[int, int] = field(default_factory=dict)

    def prompts(self, step: int) -> TensorDict:
        """The prompt batch of ``step``: drawn once from the loader (crossing epochs without a pause)."""
        if step not in self.step_prompts:
            if self.batches is None:
                self.batches = iter(self.loader)
            self.epochs[step], rows = next(self.batches)
            self.step_prompts[step] = self.train_set.batch(rows, [f"{step}-{i}" for i in range(len(rows))],
                                                           self.tokenizer.pad_token_id)
        return self.step_prompts[step]

    def restarted_rollout(self, step: int, batch: TensorDict) -> bool:
        """Whether ``batch`` came from other weights than the ones pushed before its generation started
        (Ray restarted a dead rollout worker, which then serves its initial weights)."""
        expected = self.launch_versions.pop(step, self.synced_version)
        if bool((batch["weight_version"] == expected).all()):
            return False
        logger.warning("step %d was generated with weight version %s instead of %d: the rollout worker was "
                       "restarted; re-syncing its weights and generating again", step,
                       sorted(set(batch["weight_version"].tolist())), expected)
        return True

    def call(self, name: str, step: int, *args, guard: TensorDict | None = None) -> StageResult:
        """Call stage task ``name`` for ``step`` through its step cache (when ``skip.<stage>`` covers it);
        ``guard`` is the input a cached result must have been computed from."""
        cache = self.caches.get(CACHE_STAGE[name])
        guard_fingerprint = None
        if cache is not None and cache.covers(step) and guard is not None:
            worker = WEIGHTS_OF.get(name)
            weights = self.workers.get(getattr(self.workers, worker).submit("weights_digest")) if worker else None
            guard_fingerprint = fingerprint(guard, weights=weights)
        return start_stage(cache, getattr(self.stages, name), step, *args, fingerprint=guard_fingerprint).result()

    def rollout_meta(self) -> dict:
        """What a rollout cache entry records about how it was sampled (beside its weight versions)."""
        model = self.cfg.actor_rollout_ref.model
        return {"sampling": asdict(self.sampling), "model_path": model.path,
                "tokenizer_path": model.tokenizer_path or model.path}


def start_run(cfg: PPOConfig, *, orchestrated: bool = True) -> Run:
    """Prepare data, tokenizer and scorers (cheap, so bad input fails first), then start the workers."""
    data = cfg.data
    context = data.max_prompt_length + data.max_response_length
    ensure_model(cfg.actor_rollout_ref.model, "actor_rollout_ref.model.path")
    check_context_length(cfg.actor_rollout_ref.model, context, "actor_rollout_ref.model.path")
    if cfg.use_critic:
        ensure_model(cfg.critic.model, "critic.model.path")
        check_context_length(cfg.critic.model, context, "critic.model.path")
    ensure_datasets(data)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    train_set = load_prompt_dataset(data.train_files, data, tokenizer, key="data.train_files")
    val_set = load_prompt_dataset(data.val_files, data, tokenizer, key="data.val_files") if data.val_files else None
    custom = cfg.custom_reward_function
    custom_scorer = load_custom_scorer(custom.path, custom.name) if custom.path else None
    for dataset in filter(None, (train_set, val_set)):
        for source in sorted(set(dataset.data_sources)):
            scorer_for(source, custom_scorer)  # every data source has a scorer, or fail now
    loader = PromptLoader(len(train_set), data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    total_steps = cfg.trainer.total_training_steps or cfg.trainer.total_epochs * loader.batches_per_epoch
    ctrl = cfg.algorithm.kl_ctrl
    kl_controller = make_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)
    caches = stage_caches(cfg)
    reward_chunks = 0
    if cfg.reward_model.reward_manager == "ray":
        if not orchestrated or not get_current_settings().api.url:
            raise ValueError("reward_model.reward_manager=ray scores in Prefect tasks on Ray workers, which must "
                             "report to a Prefect server: set PREFECT_API_URL (and run the flow orchestrated)")
        reward_chunks = cfg.reward_model.num_workers
    workers = start_workers(cfg) if orchestrated else start_local_workers(cfg)
    return Run(cfg, tokenizer, train_set, val_set, loader, total_steps, custom_scorer, kl_controller, workers,
               stages=STAGES if orchestrated else BARE_STAGES, sampling=SamplingParams.for_training(cfg),
               caches=caches, reward_chunks=reward_chunks)


@contextmanager
def timed(timing: dict[str, float], name: str):
    """Add the wall time of the block to ``timing[name]`` (reported as ``timing_s/<name>``)."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def generation(run: Run, step: int, *, background: bool) -> PendingStage:
    """Stage 1 for ``step``: in the background (a Prefect future on the rollout worker) or when awaited."""
    prompts = run.prompts(step)
    run.launch_versions[step] = run.synced_version
    return start_stage(run.caches.get("rollout"), run.stages.generate, step, run.workers, prompts, step, run.sampling,
                       meta=run.rollout_meta(), prompt_uids=non_tensor_column(prompts, "uid"),
                       n=run.cfg.actor_rollout_ref.rollout.n, background=background)


def sync_weights(run: Run) -> int:
    """Stage 6: the rollout worker takes the actor's current weights."""
    collective = run.cfg.actor_rollout_ref.rollout.weight_sync.backend != "object_store"
    run.synced_version = run.stages.weight_sync(run.workers, collective)
    return run.synced_version


def ppo_update(run: Run, step: int, batch: TensorDict, metrics: dict[str, float], timing: dict[str, float]) -> None:
    """Stages 2-5 on a generated batch: reward, log-probs, advantage, critic and actor updates."""
    cfg, workers, stages = run.cfg, run.workers, run.stages
    correction = cfg.algorithm.rollout_correction
    # 2. reward
    with timed(timing, "reward"):
        scored = run.call("reward", step, batch, run.tokenizer, run.custom_scorer, run.reward_chunks, guard=batch)
    batch.update(scored.fields)
    metrics.update(scored.metrics)
    batch_ref = workers.put(batch.exclude(*NON_TENSOR_FIELDS))  # one copy, read by every role below
    # 3. log-probs of the pre-update policy (bypass mode: the rollout's own), ref log-probs and values
    if correction.bypass_mode:
        batch["old_log_probs"] = batch["rollout_log_probs"]
    else:
        with timed(timing, "old_log_prob"):
            computed = run.call("old_log_prob", step, workers, batch_ref, guard=batch)
        batch.update(computed.fields)
        metrics.update(computed.metrics)
        metrics.update(correct_off_policy(batch, correction))
    for name, stage, needed in (("ref", "ref_log_prob", cfg.use_reference), ("values", "values", cfg.use_critic)):
        if needed:
            with timed(timing, name):
                computed = run.call(stage, step, workers, batch_ref, guard=batch)
            batch.update(computed.fields)
            metrics.update(computed.metrics)
    # 4. advantage
    with timed(timing, "adv"):
        estimated = run.call("advantage", step, batch, cfg.algorithm, run.kl_controller, guard=batch)
    batch.update(estimated.fields)
    metrics.update(estimated.metrics)
    batch_ref = workers.put(batch.exclude(*NON_TENSOR_FIELDS))
    # 5. update the critic, then the actor
    if cfg.use_critic:
        with timed(timing, "update_critic"):
            metrics.update(stages.update_critic(workers, batch_ref, step))
    with timed(timing, "update_actor"):
        metrics.update(stages.update_actor(workers, batch_ref, step))
    metrics.update(data_metrics(batch))


def correct_off_policy(batch: TensorDict, correction) -> dict[str, float]:
    """How far the trainer's old log-probs are from the rollout's sampling log-probs (verl's
    ``training/rollout_probs_diff_*``), and verl's decoupled correction for it: rejection-mask and/or
    IS-weight the trajectories (``rollout_corr/*`` metrics)."""
    valid = batch["response_mask"].bool()
    gap = (batch["old_log_probs"].exp() - batch["rollout_log_probs"].exp()).abs()[valid]
    metrics = {"training/rollout_probs_diff_max": float(gap.max()), "training/rollout_probs_diff_mean": float(gap.mean())}
    if correction.rollout_rs:
        batch["response_mask"], rejected = compute_rejection_mask(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
            options=correction.rollout_rs, thresholds=correction.rollout_rs_threshold)
        metrics.update(rejected)
    if correction.rollout_is:
        batch["rollout_is_weights"], weighted = compute_rollout_is_weights(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], level=correction.rollout_is,
            threshold=correction.rollout_is_threshold, batch_normalize=correction.rollout_is_batch_normalize)
        metrics.update(weighted)
    return metrics


def train_steps(run: Run, steps: range, *, in_flight: PendingStage | None = None,
                after_step: Callable[[int, PendingStage | None], PendingStage | None] | None = None,
                ) -> Iterator[tuple[int, dict[str, float]]]:
    """The training loop over ``steps``; yields each step and its metrics.

    ``sync``: generate, train, push the new weights. ``one_step_off`` (verl's order): wait for the
    batch generated during the previous step (with the weights before that step's update), push the
    current weights, start generating the next batch, then train on this one - so generation
    overlaps training and every sample is exactly one update old. A step the rollout cache will
    replay starts no generation. ``in_flight`` is a resumed run's already generated first batch;
    ``after_step(step, pending)`` runs once the step's metrics are consumed (checkpointing).
    """
    one_step_off = run.cfg.trainer.mode == "one_step_off"
    pending = in_flight
    for step in steps:
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        with timed(timing, "step"):
            # 1. generate (sync), or wait for the batch started during the previous step (one_step_off)
            with timed(timing, "gen"):
                generated = (pending or generation(run, step, background=one_step_off)).result()
                if generated.metrics.get("skip/rollout/hit") != 1.0 and run.restarted_rollout(step, generated.fields):
                    sync_weights(run)  # a restarted rollout worker serves its initial weights: re-sync, regenerate
                    generated = generation(run, step, background=False).result()
                    metrics["training/rollout_regenerated"] = 1.0
            run.step_prompts.pop(step, None)
            batch = generated.fields
            metrics.update(generated.metrics)
            pending = None
            if one_step_off:
                # 6. (one_step_off) push the current weights, then start the next batch before training
                with timed(timing, "sync_rollout_weights"):
                    with timed(timing, "update_weights"):
                        sync_weights(run)
                    if step < steps[-1]:
                        pending = generation(run, step + 1, background=True)
            # 2.-5. reward, log-probs, advantage, update
            ppo_update(run, step, batch, metrics, timing)
            if not one_step_off:
                # 6. push the new weights to the rollout worker
                with timed(timing, "update_weights"):
                    sync_weights(run)
        if generated.metrics.get("skip/rollout/hit") != 1.0:  # a replayed batch's weight versions are history
            staleness = (step - 1 - batch["weight_version"]).float()
            metrics.update({"training/off_policy/trajectory_staleness/mean": float(staleness.mean()),
                            "training/off_policy/trajectory_staleness/max": float(staleness.max())})
        if generated.background_seconds is not None:
            metrics["timing_s/generate_async"] = generated.background_seconds
            metrics["perf/generate_overlap_ratio"] = max(0.0, 1 - timing["gen"] / max(generated.background_seconds, 1e-9))
        metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
        yield step, metrics
        if after_step is not None:
            pending = after_step(step, pending)


def validate(run: Run, step: int) -> tuple[dict[str, float], list[str]]:
    """Generate on the validation set with ``rollout.val_kwargs`` and score it.

    Returns ``val-core/{data_source}/reward/mean@{n}`` (verl's names) and a few decoded samples.
    """
    sampling = SamplingParams.for_validation(run.cfg)
    val_set = run.val_set
    rows = list(range(len(val_set)))
    size = run.cfg.data.val_batch_size or len(rows)
    per_source: dict[str, list[float]] = {}
    samples: list[str] = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        prompts = val_set.batch(chunk, [f"val-{row}" for row in chunk], run.tokenizer.pad_token_id)
        batch = run.stages.generate(run.workers, prompts, step, sampling).fields  # never cached
        scores = run.stages.reward(batch, run.tokenizer, run.custom_scorer, run.reward_chunks).fields
        sequence_scores = scores["token_level_scores"].sum(dim=1).tolist()
        for source, score in zip(non_tensor_column(batch, "data_source"), sequence_scores):
            per_source.setdefault(source, []).append(score)
        if not samples:
            prompts_text = run.tokenizer.batch_decode(batch["prompts"][:3], skip_special_tokens=True)
            responses = decode_responses(batch[:3], run.tokenizer)
            samples = [f"{p!r} -> {r!r} ({s:.2f})" for p, r, s in zip(prompts_text, responses, sequence_scores)]
    metrics = {f"val-core/{source}/reward/mean@{sampling.n}": sum(scores) / len(scores)
               for source, scores in per_source.items()}
    return metrics, samples


def validation_line(step: int, metrics: dict[str, float], samples: list[str]) -> str:
    """One console line: the validation rewards and a few decoded samples."""
    rewards = ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
    return f"step {step} validation: {rewards}; samples: {', '.join(samples)}"


def train(cfg: PPOConfig, *, orchestrated: bool = True) -> dict[str, float]:
    """Run the whole training loop (resuming from a checkpoint when there is one); returns the last step's metrics."""
    run = start_run(cfg, orchestrated=orchestrated)
    metrics: dict[str, float] = {}
    tracker = None
    try:
        resume = resume_point(cfg)
        first_step, in_flight = 1, None
        if resume:
            first_step, in_flight = restore(run, resume)
            sync_weights(run)  # the rollout worker serves the restored weights
        tracker = Tracker(cfg.trainer.default_local_dir, cfg.trainer.logger, run.total_steps, first_step=first_step)
        artifacts = RunArtifacts(cfg, run.total_steps, first_step=first_step)
        if resume:
            tracker.note(f"resumed from {resume}: continuing at step {first_step}")
        test_freq = cfg.trainer.test_freq if run.val_set is not None else 0
        save_freq = cfg.trainer.save_freq
        if test_freq > 0 and cfg.trainer.val_before_train and first_step == 1:
            val_metrics, samples = validate(run, step=0)
            tracker.note(validation_line(0, val_metrics, samples))

        def after_step(step: int, pending: PendingStage | None) -> PendingStage | None:
            if save_freq > 0 and (step % save_freq == 0 or step == run.total_steps):
                directory, pending = save_checkpoint(run, step, pending)
                tracker.note(f"checkpoint written to {directory}")
            return pending

        steps = range(first_step, run.total_steps + 1)
        for step, metrics in train_steps(run, steps, in_flight=in_flight, after_step=after_step):
            metrics.update({"training/global_step": step, "training/epoch": run.epochs.pop(step)})
            if test_freq > 0 and (step % test_freq == 0 or step == run.total_steps):
                if cfg.trainer.mode == "one_step_off":
                    sync_weights(run)  # validate this step's weights, not the ones the next batch samples with
                val_metrics, samples = validate(run, step)
                metrics.update(val_metrics)
                tracker.note(validation_line(step, val_metrics, samples))
            tracker.log(step, metrics)
            artifacts.step(step, metrics)
        final_model = f"{cfg.trainer.default_local_dir}/global_step_{run.total_steps}/actor/huggingface"
        run.workers.get(run.workers.actor.submit("save_pretrained", final_model))
        tracker.note(f"trained policy written to {final_model}")
        curve = artifacts.finish(read_metrics(cfg.trainer.default_local_dir), checkpoint=latest(cfg.trainer.default_local_dir),
                                 caches=[cache.cache.root for cache in run.caches.values()])
        tracker.note(f"reward curve written to {curve}")
    finally:
        if tracker is not None:
            tracker.close()
        run.workers.shutdown()
    return metrics


@flow(name="ppo-train", log_prints=True)
def ppo_train(
    config: str = "grpo_tiny",
    overrides: list[str] = [],  # noqa: B006 - a plain list default keeps the parameter optional in Prefect's schema
    experiment_name: Optional[str] = None,
    total_training_steps: Annotated[Optional[int], Field(ge=1)] = None,
    mode: Optional[Literal["sync", "one_step_off"]] = None,
) -> dict[str, float]:
    """Train a policy with PPO/GRPO.

    The run's config is the preset (or YAML file) with the overrides merged over it; the typed
    fields, when set, are applied last. An invalid config fails the run at once, naming the key.

    Args:
        config: Preset in configs/ (grpo_tiny, ppo_trainer) or a path to a YAML file.
        overrides: key=value overrides, one per row, e.g. actor_rollout_ref.rollout.n=4 or skip.rollout.steps=[1,2].
        experiment_name: trainer.experiment_name (names the run and cache directories).
        total_training_steps: trainer.total_training_steps.
        mode: trainer.mode: sync, or one_step_off (generation overlaps the update).
    """
    typed = {"trainer.experiment_name": experiment_name, "trainer.total_training_steps": total_training_steps,
             "trainer.mode": mode}
    cfg = load_config(config, [*overrides, *(f"{key}={value}" for key, value in typed.items() if value is not None)])
    get_run_logger().info("run directory %s", cfg.trainer.default_local_dir)
    # Each task run's "Finished in state Completed()" line costs ~3 ms of console rendering and buries
    # the progress bar; task states still reach the Prefect API and UI without it.
    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    return train(cfg)
