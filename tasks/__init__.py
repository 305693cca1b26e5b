"""The PPO stages, one Prefect task per module, in the order a step runs them: ``generate``,
``reward``, ``log_prob`` (old and reference log-probs), ``values``, ``advantage``, ``update`` (critic,
actor), ``weight_sync``; and ``algorithms``, the pure math they use.

Tasks are thin: they call a long-lived worker (through ``workers.group``) or a pure function from
``algorithms`` and return its result. None of them hashes its inputs (``NO_CACHE``): batches
are tensors, and hashing them would cost more than the stage. Importing this package imports
nothing else, so the pure math stays usable without Prefect.
"""
