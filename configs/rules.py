"""Rules that relate several config keys: checked after the schema, before anything starts.

Each rule returns ``(key, message)`` pairs naming the key a user should change; :func:`cross_field_errors`
collects them all, so one run of ``ppoflow config`` lists every problem at once. A check of one key alone
belongs in the schema (a field validator). When the schema refuses a config, the loader still runs these
rules on a stand-in with the refused keys at their defaults, so they report in the same round.
"""

from __future__ import annotations

import re

from ppoflow.configs.modes import mode_errors, needs_of
from ppoflow.configs.rules_dapo import dapo_errors
from ppoflow.configs.rules_lora import lora_errors
from ppoflow.configs.rules_policy_loss import policy_loss_errors
from ppoflow.configs.rules_profiler import profiler_errors
from ppoflow.configs.rules_resources import data_parallel_errors, resource_errors
from ppoflow.configs.rules_reward_model import reward_model_errors
from ppoflow.configs.rules_vllm import vllm_errors
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.stages import SAMPLE_CACHE_KEY

SECRET_OPTION = re.compile(r"key|secret|token|password|credential", re.IGNORECASE)
"""fsspec option names that carry credentials (s3fs: key, secret, token)."""


def cross_field_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """Rules that relate several keys, as ``(key, message)`` pairs; empty when the config is coherent."""
    errors: list[tuple[str, str]] = []
    data, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    trajectories = data.train_batch_size * rollout.n
    mini = actor.ppo_mini_batch_size * rollout.n
    if trajectories % mini:
        errors.append(
            (
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                f"data.train_batch_size * rollout.n = {trajectories} trajectories is not divisible by "
                f"ppo_mini_batch_size * rollout.n = {mini}",
            )
        )
    if actor.ppo_micro_batch_size_per_gpu and mini % actor.ppo_micro_batch_size_per_gpu:
        errors.append(
            (
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                f"{actor.ppo_micro_batch_size_per_gpu} does not divide the mini-batch of {mini} trajectories",
            )
        )
    if cfg.use_critic:
        critic_mini = cfg.critic.ppo_mini_batch_size * rollout.n
        if trajectories % critic_mini:
            errors.append(
                (
                    "critic.ppo_mini_batch_size",
                    f"{trajectories} trajectories per step are not divisible by critic mini-batch {critic_mini}",
                )
            )
        if cfg.critic.ppo_micro_batch_size_per_gpu and critic_mini % cfg.critic.ppo_micro_batch_size_per_gpu:
            errors.append(
                (
                    "critic.ppo_micro_batch_size_per_gpu",
                    f"{cfg.critic.ppo_micro_batch_size_per_gpu} does not divide the critic mini-batch of {critic_mini}",
                )
            )
    if cfg.algorithm.adv_estimator == "gae" and not cfg.use_critic:
        errors.append(("critic.enable", "algorithm.adv_estimator=gae needs a critic; set critic.enable=true or null"))
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and rollout.n < 2:
        errors.append(
            (
                "actor_rollout_ref.rollout.n",
                f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses of one prompt "
                f"and needs n >= 2, got {rollout.n}",
            )
        )
    if cfg.trainer.resume_mode == "resume_path" and not re.search(
        r"global_step_\d+/?$", cfg.trainer.resume_from_path or ""
    ):
        errors.append(
            (
                "trainer.resume_from_path",
                f"resume_mode=resume_path needs a .../global_step_N directory, got {cfg.trainer.resume_from_path!r}",
            )
        )
    if cfg.trainer.test_freq > 0 and data.val_files is None:
        errors.append(("data.val_files", f"trainer.test_freq={cfg.trainer.test_freq} needs validation files"))
    stage_runs = {
        "ref": cfg.use_reference,
        "values": cfg.use_critic,
        SAMPLE_CACHE_KEY: cfg.actor_rollout_ref.rollout.mode == "async",
    }
    for stage, skip in cfg.skip.items():
        if not skip.enable:
            continue
        if not skip.steps:
            errors.append((f"skip.{stage}.steps", "caching is enabled but no step is listed"))
        if not stage_runs.get(stage, True):
            errors.append(
                (
                    f"skip.{stage}.enable",
                    "caches the rollout service's samples: it needs actor_rollout_ref.rollout.mode=async"
                    if stage == SAMPLE_CACHE_KEY
                    else f"this run has no {stage} stage to cache",
                )
            )
        secrets = sorted(key for key in skip.storage_options if SECRET_OPTION.search(key))
        if secrets:
            errors.append(
                (
                    f"skip.{stage}.storage_options",
                    f"holds credentials {secrets}; configs are stored in "
                    "Prefect run parameters, so pass credentials through the environment (e.g. "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or an instance role instead",
                )
            )
    errors += resource_errors(cfg) + data_parallel_errors(cfg) + _correction_errors(cfg) + lora_errors(cfg)
    errors += dapo_errors(cfg)
    errors += policy_loss_errors(cfg) + reward_model_errors(cfg) + profiler_errors(cfg)
    if (
        cfg.skip.get("advantage")
        and cfg.skip["advantage"].enable
        and cfg.algorithm.use_kl_in_reward
        and cfg.algorithm.kl_ctrl.type == "adaptive"
    ):
        errors.append(
            (
                "skip.advantage.enable",
                "a replayed advantage cannot replay the adaptive KL controller's "
                "update; use algorithm.kl_ctrl.type=fixed or leave skip.advantage off",
            )
        )
    if rollout.name == "vllm":
        errors += vllm_errors(cfg)
    if rollout.mode == "async":
        errors += _rollout_service_errors(cfg) + _gateway_errors(rollout)
    elif rollout.agent.gateway.enable:
        errors.append(("actor_rollout_ref.rollout.agent.gateway.enable", "the gateway needs rollout.mode=async"))
    errors += mode_errors(cfg) + _token_budget_errors(cfg)
    if cfg.actor_rollout_ref.hybrid_engine:
        errors += _colocation_errors(cfg)
    return errors


def _colocation_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """What ``actor_rollout_ref.hybrid_engine=true`` (the actor's ranks generate too) cannot combine with (a vllm
    engine's own needs: :func:`~ppoflow.configs.rules_vllm.vllm_errors`)."""
    rollout, key = cfg.actor_rollout_ref.rollout, "actor_rollout_ref.hybrid_engine"
    if not needs_of(cfg.trainer.mode).on_policy:
        return [
            (
                key,
                f"trainer.mode={cfg.trainer.mode} generates while the actor trains, so its rollout needs devices "
                "of its own (verl's rule): set hybrid_engine=false (or null) and give the rollout its own pool "
                "(rollout.nnodes, rollout.n_gpus_per_node and actor_rollout_ref.rollout.resources; "
                "docs/scale_out.md#layouts)",
            )
        ]
    if rollout.weight_sync.backend != "object_store":
        return [
            (
                key,
                f"rollout.weight_sync.backend={rollout.weight_sync.backend} sends weights between two workers; "
                "a colocated rollout already holds them: use object_store, or hybrid_engine=false",
            )
        ]
    return []


def _rollout_service_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """What the rollout service (``rollout.mode=async``) does not run with yet."""
    rollout, errors = cfg.actor_rollout_ref.rollout, []
    if rollout.name != "hf":
        errors.append(
            (
                "actor_rollout_ref.rollout.mode",
                f"async serves the hf engine only so far, not rollout.name={rollout.name}",
            )
        )
    if rollout.weight_sync.backend != "object_store":
        errors.append(
            (
                "actor_rollout_ref.rollout.weight_sync.backend",
                f"{rollout.weight_sync.backend} pairs the actor with one rollout worker; rollout.mode=async "
                "pushes weights to every replica through the object store",
            )
        )
    reward_cache = cfg.skip.get("reward")
    streamed = cfg.reward_model.reward_manager == "naive" and not cfg.reward_model.model_stage
    if reward_cache is not None and reward_cache.enable and streamed:
        errors.append(
            (
                "skip.reward.enable",
                "rollout.mode=async scores each trajectory as it finishes, so there is "
                "no reward stage to cache: the rollout cache (skip.rollout) keeps the "
                "scores",
            )
        )
    multi_turn = rollout.multi_turn
    offered_by_requests = rollout.agent.gateway.enable and rollout.agent.default_agent_loop == "openai_agent"
    if multi_turn.format == "question_mark" and multi_turn.tool_config_path is None and not offered_by_requests:
        errors.append(
            (
                "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                "multi_turn.format=question_mark calls the first declared tool: declare one",
            )
        )
    return errors


def _gateway_errors(rollout) -> list[tuple[str, str]]:
    """The ``openai_agent`` loop needs the gateway and an agent function; a fixed port serves one worker."""
    agent, errors = rollout.agent, []
    if agent.default_agent_loop == "openai_agent" and not agent.gateway.enable:
        errors.append(("actor_rollout_ref.rollout.agent.gateway.enable", "openai_agent calls the gateway: set true"))
    if agent.default_agent_loop == "openai_agent" and agent.agent_function.path is None:
        errors.append(("actor_rollout_ref.rollout.agent.agent_function.path", "openai_agent needs an agent function"))
    if agent.gateway.port and agent.num_workers > 1:
        errors.append(
            (
                "actor_rollout_ref.rollout.agent.gateway.port",
                f"{agent.gateway.port} can serve one agent worker, not agent.num_workers={agent.num_workers}: use 0",
            )
        )
    return errors


def _token_budget_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """With dynamic bsz each micro-batch holds whole sequences, so its token budget must hold the longest one a
    batch can have: data.max_prompt_length + data.max_response_length tokens."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    actor, ref, rollout = arr.actor, arr.ref, arr.rollout
    critic_dynamic = critic.use_dynamic_bsz and cfg.use_critic
    budgets = [
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu),
        (
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            rollout.log_prob_use_dynamic_bsz,
            rollout.log_prob_max_token_len_per_gpu,
        ),
        (
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            ref.log_prob_use_dynamic_bsz and cfg.use_reference,
            ref.log_prob_max_token_len_per_gpu,
        ),
        ("critic.ppo_max_token_len_per_gpu", critic_dynamic, critic.ppo_max_token_len_per_gpu),
        ("critic.forward_max_token_len_per_gpu", critic_dynamic, critic.forward_max_token_len_per_gpu),
    ]
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    return [
        (
            key,
            f"{budget} tokens cannot hold a sequence of data.max_prompt_length + data.max_response_length = "
            f"{longest} tokens (dynamic bsz); raise it to at least {longest}, or shorten those",
        )
        for key, dynamic, budget in budgets
        if dynamic and budget < longest
    ]


def _correction_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """The rollout-correction thresholds parse, and bypass mode is not combined with what it skips (the
    parsers, and torch with them, are imported only when a correction is configured)."""
    errors: list[tuple[str, str]] = []
    correction = cfg.algorithm.rollout_correction
    key = "algorithm.rollout_correction"
    if correction.rollout_is is not None:
        from ppoflow.algorithms.correction import parse_is_threshold

        try:
            parse_is_threshold(correction.rollout_is_threshold)
        except (TypeError, ValueError) as error:
            errors.append((f"{key}.rollout_is_threshold", str(error)))
    if correction.rollout_rs is not None:
        if correction.rollout_rs_threshold is None:
            errors.append((f"{key}.rollout_rs_threshold", f"rollout_rs={correction.rollout_rs!r} needs thresholds"))
        else:
            import torch

            from ppoflow.algorithms.correction import compute_rejection_mask

            # the real parser on a one-token batch (same messages as at run time): the options with a bound
            # every option takes, then the configured bounds, so the problem names the key that holds it
            for name, thresholds in (("rollout_rs", 1.0), ("rollout_rs_threshold", correction.rollout_rs_threshold)):
                try:
                    compute_rejection_mask(
                        torch.zeros(1, 1),
                        torch.zeros(1, 1),
                        torch.ones(1, 1),
                        options=correction.rollout_rs,
                        thresholds=thresholds,
                    )
                except (TypeError, ValueError) as error:
                    errors.append((f"{key}.{name}", str(error)))
                    break
    if correction.bypass_mode and (correction.rollout_is or correction.rollout_rs):
        errors.append(
            (
                f"{key}.bypass_mode",
                "bypass mode with rollout_is / rollout_rs is not supported yet: verl then weights and masks the "
                "loss by the current policy against the rollout's (its bypass_mode loss); here set "
                "bypass_mode=false (decoupled: old log-probs against the rollout's), or leave out rollout_is and "
                "rollout_rs",
            )
        )
    return errors
