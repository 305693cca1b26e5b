"""The run's long-lived workers, in three rooms and a hall.

- :mod:`~ppoflow.workers.training`: the training roles (actor, reference, critic), their shared update loop and
  data parallelism;
- :mod:`~ppoflow.workers.rollout`: the generation engines of the rollout role (transformers, vLLM);
- :mod:`~ppoflow.workers.service`: the rollout service (``rollout.mode=async``: replicas, agent loops, tools)
  and the sandbox processes that run user code (tools, custom scorers);
- here: the roles as tasks call them (:mod:`.roles`), starting them on Ray (:mod:`.launcher`, :mod:`.resources`),
  and what every room shares: model loading (:mod:`.models`), weight sync, and the batch transport.
"""
