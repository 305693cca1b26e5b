"""What the run's roles reserve (all ranks, all replicas) and whether the Ray cluster has room for it: a config
error naming the key to change, rather than actors or scoring tasks left pending forever."""

from __future__ import annotations

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig, ResourcesConfig


def role_resources(cfg: PPOConfig) -> dict[str, ResourcesConfig]:
    """The resources every role this config runs reserves in all (all ranks, all replicas), keyed by the
    config key that sets them (with the count of actors when there are several)."""
    ranks = cfg.data_parallel_size
    roles = {_times("actor_rollout_ref.actor", ranks, "ranks"): _scaled(cfg.actor_rollout_ref.actor.resources, ranks)}
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode == "async":  # one set of rollout.resources per replica
        replicas = rollout.num_replicas
        roles[f"actor_rollout_ref.rollout ({replicas} replicas)"] = _scaled(rollout.resources, replicas)
    elif not cfg.colocated:
        roles["actor_rollout_ref.rollout"] = rollout.resources
    if cfg.use_reference and not cfg.ref_in_actor:
        roles[_times("actor_rollout_ref.ref", ranks, "ranks")] = _scaled(cfg.actor_rollout_ref.ref.resources, ranks)
    if cfg.use_critic:
        roles[_times("critic", ranks, "ranks")] = _scaled(cfg.critic.resources, ranks)
    if cfg.reward_model.enable:
        roles["reward_model"] = cfg.reward_model.resources
    judge = cfg.reward_model.judge
    if cfg.judge_model is not None:
        roles[_times("reward_model.judge", judge.num_replicas, "replicas")] = _scaled(
            judge.resources, judge.num_replicas
        )
    return roles


def _times(key: str, count: int, what: str) -> str:
    return key if count == 1 else f"{key} ({count} {what})"


def _scaled(resources: ResourcesConfig, count: int) -> ResourcesConfig:
    """What ``count`` actors of ``resources`` reserve together."""
    return resources.model_copy(
        update={
            "num_cpus": resources.num_cpus * count,
            "num_gpus": resources.num_gpus * count,
            "custom": {name: value * count for name, value in resources.custom.items()},
        }
    )


def ray_resources(resources: ResourcesConfig) -> dict[str, float]:
    """``resources`` as Ray names them, zero amounts left out."""
    named = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.custom}
    return {name: amount for name, amount in named.items() if amount > 0}


def scoring_cpus(cfg: PPOConfig) -> int:
    """CPUs the reward stage's Ray tasks use at once (``reward_model.reward_manager=ray``: one per chunk)."""
    return cfg.reward_model.num_workers if cfg.reward_model.reward_manager == "ray" else 0


_RESOURCE_KEYS = {"CPU": "num_cpus", "GPU": "num_gpus"}
"""How the config names a Ray resource of a role (a custom one is ``custom.<name>``)."""


def check_fits(roles: dict[str, ResourcesConfig], *, scores_on_ray: bool) -> None:
    """Fail now, with a :class:`ConfigError` naming the key of the role that asks most, rather than leave
    an actor or a scoring task pending forever: CPUs, GPUs and every custom resource the roles reserve,
    against the whole Ray cluster.

    Scoring on Ray needs one CPU beyond the actors' so that at least one chunk runs."""
    import ray

    available = ray.cluster_resources()
    wanted = {name for resources in roles.values() for name in ray_resources(resources)} | {"CPU"}
    for unit in sorted(wanted):
        needed = sum(ray_resources(resources).get(unit, 0.0) for resources in roles.values())
        details = [f"{key}: {ray_resources(resources).get(unit, 0.0):g}" for key, resources in roles.items()]
        if unit == "CPU" and scores_on_ray:
            needed += 1
            details.append("1 for reward_model.reward_manager=ray")
        if needed > available.get(unit, 0):
            largest = max(roles, key=lambda key: ray_resources(roles[key]).get(unit, 0.0)).split(" (")[0]
            key = f"{largest}.resources.{_RESOURCE_KEYS.get(unit, f'custom.{unit}')}"
            raise ConfigError(
                [
                    (
                        key,
                        f"the roles need {needed:g} {unit} but the Ray cluster has "
                        f"{available.get(unit, 0):g} ({', '.join(details)}); lower the roles' resources, "
                        f"or set ray.num_cpus, or join a larger cluster (ray.address)",
                    )
                ]
            )
