"""The rollout service (``rollout.mode=async``): generation replicas with continuous batching, agent-loop workers,
tools; and the sandbox processes that run user code (tools, custom scorers). Details: docs/rollout_service.md."""
