"""Rules of the model-based rewards (``reward_model.enable``, ``.remote``, ``.judge``): a reward model needs its
path, a judge its parser and the rollout service (a judge model, a judge), and one model-based reward scores a run,
not two."""

from __future__ import annotations

from ppoflow.configs.schema import PPOConfig


def reward_model_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``(key, message)`` for each problem of the reward model settings."""
    rewards, errors = cfg.reward_model, []
    if rewards.enable and not rewards.model.path:
        errors.append(("reward_model.model.path", "needed when reward_model.enable=true: the reward model to load"))
    if rewards.enable and rewards.remote.url:
        errors.append(
            (
                "reward_model.remote.url",
                "one model-based reward at a time: reward_model.enable=true loads a reward model, so leave the "
                "reward service's url null (or set reward_model.enable=false)",
            )
        )
    cache = cfg.skip.get("reward_model")
    if cache is not None and cache.enable and not rewards.model_stage:
        errors.append(
            (
                "skip.reward_model.enable",
                "no reward_model stage to cache: it runs with a reward model (reward_model.enable) or a reward "
                "service (reward_model.remote.url)",
            )
        )
    judge = rewards.judge
    if judge.model.path is not None and judge.prompt_template is None:
        errors.append(
            (
                "reward_model.judge.model.path",
                "a judge model without a judge: set reward_model.judge.prompt_template (and parser_path), or "
                "leave the path null",
            )
        )
    if judge.prompt_template is not None:
        if not judge.parser_path:
            errors.append(("reward_model.judge.parser_path", "needed with a judge: it turns the verdict into a score"))
        if cfg.actor_rollout_ref.rollout.mode != "async" or rewards.reward_manager != "naive":
            errors.append(
                (
                    "reward_model.judge.prompt_template",
                    "the judge runs on the rollout service's replicas as trajectories finish: it needs "
                    "actor_rollout_ref.rollout.mode=async and reward_model.reward_manager=naive",
                )
            )
        if rewards.model_stage:
            errors.append(
                (
                    "reward_model.judge.prompt_template",
                    "one model-based reward at a time: drop the judge, or reward_model.enable and remote.url",
                )
            )
    return errors
