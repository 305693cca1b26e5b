"""Stage 4, advantage: token rewards (scores minus an optional KL penalty) and the configured
advantage estimator. Cheap tensor math on the driver; the formulas are in ``algorithms``."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE
from tensordict import TensorDict

from ppoflow.algorithms.advantages import compute_advantage
from ppoflow.algorithms.kl import apply_kl_penalty
from ppoflow.configs.schema import AlgorithmConfig
from ppoflow.storage.batch import StageResult
from ppoflow.tasks.task_inputs import recorded_task


@recorded_task(name="advantage", cache_policy=NO_CACHE)
def advantage(batch: TensorDict, algorithm: AlgorithmConfig, kl_controller) -> StageResult:
    """``token_level_rewards``, ``advantages`` and ``returns`` [N, R]; updates the adaptive KL controller."""
    metrics: dict[str, float] = {}
    rewards = batch["token_level_scores"]
    if algorithm.use_kl_in_reward:
        rewards, current_kl = apply_kl_penalty(
            rewards,
            batch["old_log_probs"],
            batch["ref_log_probs"],
            batch["response_mask"],
            kl_controller.value,
            algorithm.kl_penalty,
        )
        metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": kl_controller.value}
        kl_controller.update(current_kl, n_steps=batch.batch_size[0])
    advantages, returns = compute_advantage(
        algorithm.adv_estimator,
        token_level_rewards=rewards,
        response_mask=batch["response_mask"],
        index=batch["group_index"],
        values=batch.get("values", None),
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
    )
    out = TensorDict(
        {"token_level_rewards": rewards, "advantages": advantages, "returns": returns}, batch_size=batch.batch_size
    )
    return StageResult(out, metrics)
