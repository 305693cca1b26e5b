"""The PPO stages, one Prefect task per module, in the order a step runs them: ``generate``, ``reward``,
``log_prob`` (old and reference log-probs), ``values``, ``advantage``, ``update`` (critic, actor), ``weight_sync``;
:mod:`.stages`, where each stage is declared once; and :mod:`.task_inputs`, which lets each stage's task run show
its plain arguments (a step number, a batch size) in the Prefect UI.

Tasks are thin: they call a long-lived worker or a pure function from ``ppoflow.algorithms`` and return a
:class:`~ppoflow.storage.batch.StageResult`. None of them hashes its inputs (``NO_CACHE``): batches are tensors, and
hashing them would cost more than the stage. None knows of the step cache: it wraps them from outside
(:mod:`ppoflow.flows.cached_stages`).
"""
