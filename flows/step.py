"""One training step, the algorithm stage by stage: 1 generate (1b: DAPO's dynamic sampling, which rewards and
filters the groups and generates more), 2 reward, 3 the forward passes (``old_log_prob``, ``ref_log_prob``,
``values``, submitted together), 4 advantage, 5 update, 6 weight_sync.

Stages 2-5 are :func:`ppo_update`; when 1 and 6 happen is the trainer mode's business (:mod:`ppoflow.flows.modes`),
and :func:`train_steps` is the loop of the mode's hooks around them. A non-finite value fails the run or drops the
step's update (``trainer.nonfinite``). Details: docs/architecture.md#the-stages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from ppoflow.algorithms.correction import correct_off_policy
from ppoflow.algorithms.dynamic_sampling import kept_groups
from ppoflow.algorithms.finite import NonFiniteError, describe_rows, nonfinite_rows
from ppoflow.flows.logs import note
from ppoflow.flows.metrics import aggregate_updates, data_metrics
from ppoflow.flows.modes import TrainerMode
from ppoflow.flows.profiling import StepProfiler
from ppoflow.flows.run import RunContext
from ppoflow.flows.stages import StepData
from ppoflow.flows.state import TrainerState
from ppoflow.storage.batch import concatenate, non_tensor_column
from ppoflow.tasks.reward import shape_overlong
from ppoflow.tasks.stages import GENERATE

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
    reward(run, step)  # 2. reward (done already for a batch that dynamic sampling filtered)
    # 3. log-probs of the pre-update policy (bypass mode: the rollout's own; an on-policy update: its own,
    #    in stage 5), reference log-probs, values; the batch is placed once for the passes that run
    recompute_old = not correction.bypass_mode and not cfg.old_log_probs_from_update
    if correction.bypass_mode:
        batch["old_log_probs"] = batch["rollout_log_probs"]
    shared = run.share(batch) if recompute_old or cfg.use_reference or cfg.use_critic else None
    # independent passes on their own workers, computed side by side; π_old is the mode's (step.old_policy)
    stages.forward_passes(
        step, shared, old_log_prob=recompute_old, ref_log_prob=cfg.use_reference, values=cfg.use_critic
    )
    if recompute_old:
        correct_for_the_rollout(step, correction)  # verl's decoupled correction of the sampling policy's lag
    # 4. advantage: token rewards (scores minus an optional KL penalty), then the estimator
    stages.advantage(step, batch=batch, algorithm=cfg.algorithm, kl_controller=state.kl_controller)
    check_finite(step, "advantage", "advantages", "returns")
    # 5. update the critic, then the actor
    shared = run.share(batch)
    if cfg.use_critic:
        stages.update_critic(step, batch_ref=shared)
    stages.update_actor(step, batch_ref=shared)
    if not step.metrics["actor/optimizer_steps"]:  # trainer.nonfinite=skip skipped each (the actor warned which)
        raise NonFiniteError(
            f"step {step.step} update_actor: every optimizer step was skipped on a non-finite loss or gradient norm"
        )
    if cfg.old_log_probs_from_update:  # the update returned its old log-probs: how far was the rollout from them
        correct_for_the_rollout(step, correction)
        step.metrics["training/old_log_prob_skipped"] = 1.0
    step.metrics.update(data_metrics(batch))


def reward(run: RunContext, step: StepData) -> None:
    """Stage 2: score each response, on its last token (a rollout that streams the reward has scored each
    trajectory as it finished; a reward model or service scores first, stage 2a), then DAPO's overlong shaping;
    each once. :class:`NonFiniteError` on a
    non-finite reward. ``reward/useful_group_ratio``: the share of prompt groups whose scores differ (GRPO's
    signal; dynamic sampling trains only such groups)."""
    cfg, batch = run.cfg, step.batch
    if "token_level_scores" not in batch.keys():
        if run.model_reward is not None and "rm_scores" not in batch.keys():  # 2a. the model-based score
            run.stages.reward_model(step, batch=batch, tokenizer=run.tokenizer, model_reward=run.model_reward)
        filtering = cfg.algorithm.filter_groups
        run.stages.reward(
            step,
            batch=batch,
            tokenizer=run.tokenizer,
            scorer=run.custom_scorer,
            ray_chunks=run.reward_chunks,
            keep_extras=filtering.enable and filtering.metric == "acc",
            combine=cfg.reward_model.combine,
        )
    overlong, kwargs = cfg.reward_model.reward_kwargs.overlong_buffer_cfg, cfg.reward_model.reward_kwargs
    if overlong.enable and "overlong_reward" not in batch.keys():
        step.merge(shape_overlong(batch, overlong, kwargs.max_resp_len or cfg.data.max_response_length))
    check_finite(step, "reward", "token_level_scores")
    uids = non_tensor_column(batch, "uid")
    useful = kept_groups(uids, batch["token_level_scores"].sum(dim=-1).tolist())
    step.metrics["reward/useful_group_ratio"] = len(useful) / len(set(uids))  # groups whose scores differ


def dynamic_sampling(run: RunContext, mode: TrainerMode, step: StepData) -> None:
    """Stage 1b, DAPO's dynamic sampling (``algorithm.filter_groups``): reward the batch, drop the prompt groups
    whose ``metric`` is the same for every response, and take further batches from the mode (a per-step mode
    generates ``data.gen_batch_size`` more prompts, a streaming one refills the filtered groups) until
    ``mode.batch_size`` groups remain; the first that many are trained. Past ``max_num_gen_batches`` batches
    the step fails naming the key, as verl's. Metrics: ``train/num_gen_batches`` and
    ``training/filter_groups/*``."""
    settings, target = run.cfg.algorithm.filter_groups, mode.batch_size
    batches, parts, generated, kept = [step], [], 0, 0
    while True:
        current = batches[-1]
        reward(run, current)
        uids = non_tensor_column(current.batch, "uid")
        keep = set(kept_groups(uids, filter_metric(current.batch, settings.metric)))
        parts.append(current.batch[torch.tensor([uid in keep for uid in uids])])
        generated, kept = generated + len(set(uids)), kept + len(keep)
        if kept >= target:
            break
        if 0 < settings.max_num_gen_batches <= len(batches):
            raise RuntimeError(
                f"step {step.step}: {kept} of {target} prompt groups have a {settings.metric} that varies after "
                f"{len(batches)} generation batches (algorithm.filter_groups.max_num_gen_batches="
                f"{settings.max_num_gen_batches}); the prompts may be too easy or too hard for the policy, or set "
                "it to 0 for no limit"
            )
        with step.timed(GENERATE.timing):
            batches.append(mode.sample_more(step, target - kept))
    batch = concatenate(*parts, pad_token_id=run.tokenizer.pad_token_id)
    uids = non_tensor_column(batch, "uid")
    trained = dict.fromkeys(list(dict.fromkeys(uids))[:target], 0)  # the first `target` groups, in order
    for uid in uids:
        if uid in trained:
            trained[uid] += 1
    batch = batch[torch.tensor([uid in trained for uid in uids])]
    batch["group_index"] = torch.repeat_interleave(torch.arange(len(trained)), torch.tensor(list(trained.values())))
    step.batch = batch
    step.metrics = aggregate_updates([part.metrics for part in batches])
    step.metrics.update(
        {
            "train/num_gen_batches": float(len(batches)),
            "training/filter_groups/evicted_samples": float(generated - kept),
            "training/filter_groups/discarded_surplus_samples": float(kept - target),
            "training/filter_groups/kept_group_ratio": kept / generated,
        }
    )


def filter_metric(batch, metric: str) -> list[float]:
    """Each response's value of ``algorithm.filter_groups.metric``: ``acc`` its scorer's (``ValueError`` when
    the scorer reports none), ``score`` / ``seq_reward`` the sum of its (shaped) scores, ``seq_final_reward``
    that of its token rewards (the scores: the in-reward KL is not known yet)."""
    if metric != "acc":
        return batch["token_level_scores"].sum(dim=-1).tolist()
    extras = non_tensor_column(batch, "reward_extras")
    if any("acc" not in found for found in extras):
        raise ValueError("algorithm.filter_groups.metric=acc: the scorer reports no `acc` for a response; use score")
    return [float(found["acc"]) for found in extras]


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
    run.workers.actor.skip_update()
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
    finished step (validation, logging and checkpointing happen in the caller, between steps); the steps of
    ``global_profiler.steps`` are profiled, the profiles written outside the step's time."""
    profiler = StepProfiler(run.cfg, run.workers)
    mode.on_train_begin(steps)
    for number in steps:
        step = StepData(number)
        profiler.start(number)
        with step.timed("step"):
            mode.on_step_begin(step)
            updates, made = [], []
            for round_ in range(mode.updates_per_step):  # one, unless the mode trains several rounds per step
                update = StepData(number, round=round_)
                mode.on_sample_begin(update)
                with update.timed(GENERATE.timing):
                    mode.sample(update)  # 1. generate (a streaming mode: sample its replay buffer)
                if run.cfg.algorithm.filter_groups.enable:
                    dynamic_sampling(run, mode, update)  # 1b. drop groups without signal, sample more
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
            mode.on_step_end(step)  # (6. weight_sync, where the mode pushes here)
        for url in profiler.stop(number):
            note(f"step {number} profiled: {url}")
        step.metrics.update({"training/global_step": number, "training/epoch": state.finish_step(number)})
        step.metrics.update(run.workers.memory_metrics())  # each role's peaks in the step (perf/*memory*)
        yield step
    mode.on_train_end()
