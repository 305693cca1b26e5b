"""The names of the algorithms' choices, in a module that imports nothing (no torch).

The config schema lists them as the legal values of its keys, and ``ppoflow config`` / ``ppoflow --help``
must not pay for importing torch to read them; the algorithm modules dispatch on the same tuples.
"""

ADVANTAGE_ESTIMATORS: tuple[str, ...] = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
"""``algorithm.adv_estimator`` (:mod:`ppoflow.algorithms.advantages`)."""

IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""``algorithm.rollout_is``: per-token or per-sequence importance weights (:mod:`ppoflow.algorithms.correction`)."""

_BASE_KL_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_PENALTY_KINDS: tuple[str, ...] = _BASE_KL_KINDS + tuple(f"{kind}+" for kind in _BASE_KL_KINDS)
"""KL estimators, each also with a ``+`` (straight-through k2 gradient) (:mod:`ppoflow.algorithms.kl`)."""

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""How per-token losses are reduced (:func:`ppoflow.algorithms.losses.agg_loss`)."""

POLICY_LOSSES: tuple[str, ...] = ("vanilla", "gspo", "cispo", "geo_mean", "sapo", "clip_cov", "kl_cov")
"""The built-in ``actor_rollout_ref.actor.policy_loss.loss_mode`` names, in registration order
(:mod:`ppoflow.algorithms.policy_losses` registers them; a user's file may add more)."""

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""verl's names of the per-response value whose variance within a group decides whether a group is kept
(``algorithm.filter_groups.metric``, :mod:`ppoflow.algorithms.dynamic_sampling`)."""
