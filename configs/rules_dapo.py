"""Rules of DAPO's keys (``algorithm.filter_groups``, ``reward_model.reward_kwargs.overlong_buffer_cfg``) and of
``data.gen_batch_size``, which only dynamic sampling may set apart from ``data.train_batch_size``."""

from __future__ import annotations

from ppoflow.configs.modes import needs_of
from ppoflow.configs.schema import PPOConfig

FILTER = "algorithm.filter_groups"
OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg"


def dapo_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``(key, message)`` pairs for DAPO settings that cannot work together."""
    errors: list[tuple[str, str]] = []
    data, filtering = cfg.data, cfg.algorithm.filter_groups
    per_step = needs_of(cfg.trainer.mode).generate_stage
    if data.gen_batch_size is not None and data.gen_batch_size != data.train_batch_size:
        if not filtering.enable:
            errors.append(
                (
                    "data.gen_batch_size",
                    f"{data.gen_batch_size} != data.train_batch_size {data.train_batch_size}: only dynamic sampling "
                    f"({FILTER}.enable=true) generates more prompts than are trained on; leave it null",
                )
            )
        elif not per_step:
            errors.append(("data.gen_batch_size", "a streaming mode feeds prompts one at a time; leave it null"))
    if filtering.enable and filtering.metric is None:
        errors.append(
            (f"{FILTER}.metric", f"{FILTER}.enable=true needs a metric: acc, score, seq_reward or seq_final_reward")
        )
    if filtering.enable and filtering.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        errors.append(
            (
                f"{FILTER}.metric",
                "seq_final_reward with algorithm.use_kl_in_reward=true: the groups are filtered before the reference "
                "pass, so the in-reward KL is not known yet; use seq_reward or turn the in-reward KL off",
            )
        )
    reward_cache = cfg.skip.get("reward")
    if filtering.enable and reward_cache is not None and reward_cache.enable:
        errors.append(
            (
                "skip.reward.enable",
                f"{FILTER} scores several generation batches a step; their rewards are recomputed from the "
                "(cached) rollouts instead, so leave skip.reward off",
            )
        )
    overlong = cfg.reward_model.reward_kwargs.overlong_buffer_cfg
    budget = cfg.reward_model.reward_kwargs.max_resp_len or data.max_response_length
    if overlong.enable and not 1 <= overlong.len <= budget:
        errors.append((f"{OVERLONG}.len", f"{overlong.len} must be in [1, the response budget {budget}]"))
    return errors
