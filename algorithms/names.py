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
