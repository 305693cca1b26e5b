"""The policy loss a config selects (``actor_rollout_ref.actor.policy_loss``): a built-in ``loss_mode``, or one
registered by the file ``loss_module`` names. :mod:`ppoflow.configs.rules` checks it with the other rules (importing
that file, and torch, only when one is named); the actor's workers load the loss with the same function.
"""

from __future__ import annotations

from ppoflow.algorithms.names import POLICY_LOSSES
from ppoflow.algorithms.user_code import import_module
from ppoflow.configs.problems import ConfigError
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.schema_models import PolicyLossConfig

KEY = "actor_rollout_ref.actor.policy_loss"


def configured_policy_loss(policy_loss: PolicyLossConfig):
    """The loss function ``loss_mode`` names, after importing ``loss_module`` (whose ``@register_policy_loss``
    functions register themselves), or a :class:`~ppoflow.configs.problems.ConfigError` naming the key."""
    from ppoflow.algorithms.policy_losses import policy_loss_fn  # imports torch: here, not at the top

    if policy_loss.loss_module is not None:
        try:
            import_module(policy_loss.loss_module)
        except ValueError as error:
            raise ConfigError([(f"{KEY}.loss_module", str(error))]) from None
    try:
        return policy_loss_fn(policy_loss.loss_mode)
    except ValueError as error:
        message = str(error) + (
            "" if policy_loss.loss_module else " (a loss of your own: name its file in loss_module)"
        )
        raise ConfigError([(f"{KEY}.loss_mode", message)]) from None


def policy_loss_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """``loss_mode`` names a built-in loss, or (with ``loss_module``) one that file registers."""
    policy_loss = cfg.actor_rollout_ref.actor.policy_loss
    if policy_loss.loss_module is None and policy_loss.loss_mode in POLICY_LOSSES:
        return []
    try:
        configured_policy_loss(policy_loss)
    except ConfigError as error:
        return error.problems
    return []
