"""Rules of the model-based rewards (``reward_model.enable``, ``reward_model.remote``): a reward model needs its
path, and one model-based reward scores a run, not two."""

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
    return errors
