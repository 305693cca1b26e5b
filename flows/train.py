"""The PPO/GRPO training flow.

One step, read top to bottom in :func:`ppo_step`, is the algorithm::

    1. generate      sample rollout.n responses per prompt            (rollout worker)
    2. reward        score each response, on its last token           (driver)
    3. old_log_prob  log-probs of the pre-update policy               (actor worker)
       ref_log_prob  log-probs of the reference policy, for KL terms  (ref worker, when needed)
       values        V(s_t) for GAE                                   (critic worker, when needed)
    4. advantage     KL-penalised rewards, then the advantage estimator (driver)
    5. update        critic, then actor: PPO epochs over mini-batches (critic / actor workers)
    6. weight_sync   the rollout worker takes the new actor weights

Every stage is a Prefect task (``tasks/``) whose heavy work runs in a long-lived Ray actor
(``workers/``). :func:`train` runs the same steps without Prefect or Ray when asked (the overhead
benchmark's baseline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

from prefect import flow, get_run_logger
from tensordict import TensorDict

from configs import load_config
from configs.schema import PPOConfig
from flows.metrics import data_metrics
from flows.stages import PendingStage, StageResult, start_stage
from flows.tracking import Tracker
from storage.batch import NON_TENSOR_FIELDS, non_tensor_column
from storage.datasets import PromptDataset, PromptLoader, ensure_datasets, load_prompt_dataset
from tasks.advantage import advantage
from tasks.algorithms.correction import compute_rejection_mask, compute_rollout_is_weights
from tasks.algorithms.kl import make_kl_controller
from tasks.algorithms.scoring import Scorer, load_custom_scorer, scorer_for
from tasks.caching import StageCache, fingerprint, stage_caches
from tasks.generate import generate
from tasks.log_prob import old_log_prob, ref_log_prob
from tasks.reward import decode_responses, reward
from tasks.update import update_actor, update_critic
from tasks.values import values
from tasks.weight_sync import weight_sync
from workers.group import Workers, start_local_workers, start_workers
from workers.models import check_context_length, ensure_model, load_tokenizer
from workers.rollout import SamplingParams


STAGES = SimpleNamespace(generate=generate, reward=reward, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob,
                         values=values, advantage=advantage, update_critic=update_critic,
                         update_actor=update_actor, weight_sync=weight_sync)
"""The stage tasks a step calls; each call is a Prefect task run."""

BARE_STAGES = SimpleNamespace(**{name: stage.fn for name, stage in vars(STAGES).items()})
"""The same stages as plain functions: a step without any Prefect task run (benchmark baseline)."""


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
    workers = start_workers(cfg) if orchestrated else start_local_workers(cfg)
    return Run(cfg, tokenizer, train_set, val_set, loader, total_steps, custom_scorer, kl_controller, workers,
               stages=STAGES if orchestrated else BARE_STAGES, sampling=SamplingParams.for_training(cfg),
               caches=caches)


@contextmanager
def timed(timing: dict[str, float], name: str):
    """Add the wall time of the block to ``timing[name]`` (reported as ``timing_s/<name>``)."""
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def generation(run: Run, step: int, prompts: TensorDict, *, background: bool) -> PendingStage:
    """Stage 1 for ``step``: in the background (a Prefect future on the rollout worker) or when awaited."""
    return start_stage(run.caches.get("rollout"), run.stages.generate, step, run.workers, prompts, step, run.sampling,
                       meta=run.rollout_meta(), prompt_uids=non_tensor_column(prompts, "uid"),
                       n=run.cfg.actor_rollout_ref.rollout.n, background=background)


def sync_weights(run: Run) -> int:
    """Stage 6: the rollout worker takes the actor's current weights."""
    return run.stages.weight_sync(run.workers, run.cfg.actor_rollout_ref.rollout.weight_sync.backend != "object_store")


def ppo_update(run: Run, step: int, batch: TensorDict, metrics: dict[str, float], timing: dict[str, float]) -> None:
    """Stages 2-5 on a generated batch: reward, log-probs, advantage, critic and actor updates."""
    cfg, workers, stages = run.cfg, run.workers, run.stages
    correction = cfg.algorithm.rollout_correction
    # 2. reward
    with timed(timing, "reward"):
        scored = run.call("reward", step, batch, run.tokenizer, run.custom_scorer, guard=batch)
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


def train_steps(run: Run, steps: range, prompts_for: Callable[[int], TensorDict]) -> Iterator[dict[str, float]]:
    """The training loop over ``steps``; yields each step's metrics.

    ``sync``: generate, train, push the new weights. ``one_step_off`` (verl's order): wait for the
    batch generated during the previous step (with the weights before that step's update), push the
    current weights, start generating the next batch, then train on this one - so generation
    overlaps training and every sample is exactly one update old. A step the rollout cache will
    replay starts no generation.
    """
    one_step_off = run.cfg.trainer.mode == "one_step_off"
    pending = generation(run, steps[0], prompts_for(steps[0]), background=one_step_off)
    for step in steps:
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        with timed(timing, "step"):
            # 1. generate (sync), or wait for the batch started during the previous step (one_step_off)
            with timed(timing, "gen"):
                generated = pending.result()
            batch = generated.fields
            metrics.update(generated.metrics)
            if one_step_off:
                # 6. (one_step_off) push the current weights, then start the next batch before training
                with timed(timing, "sync_rollout_weights"):
                    with timed(timing, "update_weights"):
                        sync_weights(run)
                    pending = generation(run, step + 1, prompts_for(step + 1), background=True) if step < steps[-1] else None
            # 2.-5. reward, log-probs, advantage, update
            ppo_update(run, step, batch, metrics, timing)
            if not one_step_off:
                # 6. push the new weights to the rollout worker
                with timed(timing, "update_weights"):
                    sync_weights(run)
                pending = generation(run, step + 1, prompts_for(step + 1), background=False) if step < steps[-1] else None
        if generated.metrics.get("skip/rollout/hit") != 1.0:  # a replayed batch's weight versions are history
            staleness = (step - 1 - batch["weight_version"]).float()
            metrics.update({"training/off_policy/trajectory_staleness/mean": float(staleness.mean()),
                            "training/off_policy/trajectory_staleness/max": float(staleness.max())})
        if generated.background_seconds is not None:
            metrics["timing_s/generate_async"] = generated.background_seconds
            metrics["perf/generate_overlap_ratio"] = max(0.0, 1 - timing["gen"] / max(generated.background_seconds, 1e-9))
        metrics.update({f"timing_s/{name}": seconds for name, seconds in timing.items()})
        yield metrics


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
        scores = run.stages.reward(batch, run.tokenizer, run.custom_scorer).fields
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


def train(cfg: PPOConfig, *, orchestrated: bool = True) -> dict[str, float]:
    """Run the whole training loop; returns the last step's metrics."""
    run = start_run(cfg, orchestrated=orchestrated)
    tracker = Tracker(cfg.trainer.default_local_dir, cfg.trainer.logger, run.total_steps)
    test_freq = cfg.trainer.test_freq if run.val_set is not None else 0
    metrics: dict[str, float] = {}
    try:
        if test_freq > 0 and cfg.trainer.val_before_train:
            val_metrics, samples = validate(run, step=0)
            tracker.note(f"step 0 validation {val_metrics}; samples: {samples}")
        batches, epochs = iter(run.loader), {}

        def prompts_for(step: int) -> TensorDict:
            epochs[step], rows = next(batches)  # crosses epoch boundaries without a pause
            return run.train_set.batch(rows, [f"{step}-{i}" for i in range(len(rows))], run.tokenizer.pad_token_id)

        steps = range(1, run.total_steps + 1)
        for step, metrics in zip(steps, train_steps(run, steps, prompts_for)):
            metrics.update({"training/global_step": step, "training/epoch": epochs.pop(step)})
            if test_freq > 0 and (step % test_freq == 0 or step == run.total_steps):
                if cfg.trainer.mode == "one_step_off":
                    sync_weights(run)  # validate this step's weights, not the ones the next batch samples with
                val_metrics, samples = validate(run, step)
                metrics.update(val_metrics)
                tracker.note(f"step {step} validation {val_metrics}; samples: {samples}")
            tracker.log(step, metrics)
        final_model = f"{cfg.trainer.default_local_dir}/global_step_{run.total_steps}/actor/huggingface"
        run.workers.get(run.workers.actor.submit("save_pretrained", final_model))
        tracker.note(f"trained policy written to {final_model}")
    finally:
        tracker.close()
        run.workers.shutdown()
    return metrics


@flow(name="ppo-train", log_prints=True)
def ppo_train(config: str = "grpo_tiny", overrides: list[str] = []) -> dict[str, float]:  # noqa: B006 (Prefect: a default list keeps the parameter optional)
    """Train a policy with PPO/GRPO: ``config`` is a preset name or YAML path, ``overrides`` are ``key=value`` words."""
    cfg = load_config(config, overrides)
    get_run_logger().info("run directory %s", cfg.trainer.default_local_dir)
    # Each task run's "Finished in state Completed()" line costs ~3 ms of console rendering and buries
    # the progress bar; task states still reach the Prefect API and UI without it.
    logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)
    return train(cfg)
