"""Starting the run's workers, and the small interface the Prefect tasks use to call them.

Each role (rollout, actor, and when needed ref and critic) is a long-lived Ray actor on the role's ``resources``;
with W = ``PPOConfig.data_parallel_size`` > 1 each training role is W actors in one placement group
(:mod:`ppoflow.workers.data_parallel`). Tasks call ``role.submit("method", ...)`` and ``workers.get(reference)``; a
batch several roles read is placed once with ``workers.put``. :func:`start_local_workers` builds the same roles as
plain objects in this process (the overhead benchmark's baseline). Details: docs/architecture.md#workers.
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig, ResourcesConfig
from ppoflow.workers.transport import send_batches_as_plain_values

WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
"""Environment of every worker process: one OpenMP thread unless a role asks for more, quiet logs."""

FORWARDED_ENV_PREFIXES = (
    "AWS_",
    "AZURE_STORAGE_",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "FSSPEC_",
    "PREFECT_API_",
    "HF_",
    "PPOFLOW_",
)
"""The driver's environment variables (storage credentials and endpoints, the Prefect API, model caches) that
every worker gets too: on a cluster's other nodes, workers start from that node's environment, not the
driver's, and nodes share no disk or settings."""


def worker_env() -> dict[str, str]:
    """The environment every worker process gets: :data:`WORKER_ENV` plus the forwarded driver variables."""
    forwarded = {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV_PREFIXES)}
    return {**forwarded, **WORKER_ENV}


RESTARTS = 3
"""How often Ray restarts a crashed stateless worker (rollout, reference) before the run fails."""


class RayRole:
    """A role served by a Ray actor; ``submit`` returns an ``ObjectRef``."""

    def __init__(self, handle):
        self.handle = handle

    def submit(self, method: str, *args, **kwargs):
        return getattr(self.handle, method).remote(*args, **kwargs)


class RayGroupRole:
    """A training role served by one Ray actor per data-parallel rank. Every call goes to every rank (each
    works out its own share of the batch) and rank 0's reply is the role's; the other ranks' replies are
    watched by :meth:`Workers.get`, so that a rank that fails fails the call."""

    def __init__(self, handles: list):
        self.handles = handles
        self.outstanding: list = []
        """Replies of ranks other than 0 not yet seen finished."""

    def submit(self, method: str, *args, **kwargs):
        references = [getattr(handle, method).remote(*args, **kwargs) for handle in self.handles]
        self.outstanding.extend(references[1:])
        return references[0]


class LocalRole:
    """A role served by an object in this process; ``submit`` runs the call and returns its value."""

    def __init__(self, worker):
        self.worker = worker

    def submit(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)


@dataclass
class Workers:
    """The run's roles plus how to place and fetch data for them."""

    rollout: Any
    actor: Any
    ref: Any = None
    critic: Any = None
    colocated: bool = False
    """The rollout role is the actor's worker (``actor_rollout_ref.hybrid_engine``)."""
    streams_reward: bool = False
    """The rollout scores each trajectory as it finishes (the rollout service with in-process scoring)."""
    uses_ray: bool = True
    started_ray: bool = False
    placement: dict = field(default_factory=dict)
    """Role -> the Ray node id of each of its actors (rank order), for the start-up log."""
    _handles: list = field(default_factory=list)
    _placement_groups: list = field(default_factory=list)

    def roles(self) -> list[str]:
        """The roles served, by name (a colocated rollout is the actor's, so it is named with it)."""
        names = ["actor+rollout"] if self.colocated else ["actor", "rollout"]
        return names + [role for role in ("ref", "critic") if getattr(self, role) is not None]

    def placement_note(self) -> str:
        """Where each role runs, by Ray node id, rank by rank (empty when every actor is on one node and
        no role has several ranks: nothing worth saying)."""
        nodes = {node for ids in self.placement.values() for node in ids}
        if len(nodes) <= 1 and all(len(ids) == 1 for ids in self.placement.values()):
            return ""
        return "; ".join(
            f"{role} on node{'s' if len(ids) > 1 else ''} {', '.join(node[:12] for node in ids)}"
            for role, ids in self.placement.items()
        )

    def put(self, value):
        """Place ``value`` where every role can read it (Ray's object store, or nowhere in-process)."""
        if not self.uses_ray:
            return value
        import ray

        return ray.put(value)

    def get(self, reference):
        """The value behind a reference returned by ``submit`` or ``put`` (lists fetched together)."""
        if not self.uses_ray:
            return reference
        import ray

        self._raise_rank_failures(reference)
        return ray.get(reference)

    def _raise_rank_failures(self, reference) -> None:
        """Wait for ``reference`` while watching the replies of the training roles' other ranks: when one
        fails, raise its error now rather than leave rank 0 waiting in a collective for it."""
        import ray

        groups = [role for role in (self.actor, self.ref, self.critic) if isinstance(role, RayGroupRole)]
        siblings = {sibling for group in groups for sibling in group.outstanding}
        if not siblings:
            return
        wanted = set(reference) if isinstance(reference, list) else {reference}
        pending = [*wanted, *siblings]
        while wanted.intersection(pending):
            ready, pending = ray.wait(pending, num_returns=1, fetch_local=False)
            for finished in set(ready) & siblings:
                for group in groups:
                    if finished in group.outstanding:
                        group.outstanding.remove(finished)
                ray.get(finished)  # raises the rank's error

    def ready(self, references: list, timeout_s: float) -> list:
        """Those of ``references`` whose values are ready, waiting up to ``timeout_s`` for the first one."""
        import ray

        if not references:
            return []
        ready, _ = ray.wait(references, num_returns=1, timeout=timeout_s)
        if ready:  # then every other one that is ready too, without waiting
            ready, _ = ray.wait(references, num_returns=len(references), timeout=0)
        return ready

    def shutdown(self) -> None:
        """Stop the actors, and Ray itself when this run started it."""
        if not self.uses_ray:
            return
        import ray

        for handle in self._handles:
            ray.kill(handle)
        for group in self._placement_groups:
            ray.util.remove_placement_group(group)
        if self.started_ray:
            ray.shutdown()


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
    if cfg.use_reference:
        roles[_times("actor_rollout_ref.ref", ranks, "ranks")] = _scaled(cfg.actor_rollout_ref.ref.resources, ranks)
    if cfg.use_critic:
        roles[_times("critic", ranks, "ranks")] = _scaled(cfg.critic.resources, ranks)
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


def _ray_resources(resources: ResourcesConfig) -> dict[str, float]:
    """``resources`` as Ray names them, zero amounts left out."""
    named = {"CPU": resources.num_cpus, "GPU": resources.num_gpus, **resources.custom}
    return {name: amount for name, amount in named.items() if amount > 0}


def rollout_worker_class(cfg: PPOConfig) -> type:
    """The generation engine ``actor_rollout_ref.rollout.name`` selects (vLLM is imported only when it runs)."""
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        from ppoflow.workers.vllm_rollout import VLLMRolloutWorker

        return VLLMRolloutWorker
    from ppoflow.workers.rollout import HFRolloutWorker

    return HFRolloutWorker


def actor_worker_class(cfg: PPOConfig) -> type:
    """The actor's worker: one that also generates when the rollout is colocated with it."""
    from ppoflow.workers.policy import ActorWorker, ColocatedActorWorker

    return ColocatedActorWorker if cfg.colocated else ActorWorker


def start_workers(cfg: PPOConfig) -> Workers:
    """Join (or start) Ray, check the roles fit, start the actors of every role and wait until all loaded."""
    import ray

    from ppoflow.workers.critic import CriticWorker
    from ppoflow.workers.policy import ReferenceWorker

    roles = role_resources(cfg)
    started_ray = _connect_ray(cfg, roles)
    send_batches_as_plain_values()
    _check_fits(roles, scores_on_ray=scoring_cpus(cfg) > 0)

    def actor_of(cls, resources: ResourcesConfig, *args, restartable: bool = False, **options):
        env = {**worker_env(), "OMP_NUM_THREADS": str(resources.num_threads)}
        return (
            ray.remote(cls)
            .options(
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                resources=dict(resources.custom),
                max_restarts=RESTARTS if restartable else 0,
                max_task_retries=RESTARTS if restartable else 0,
                runtime_env={"env_vars": env},
                **options,
            )
            .remote(cfg, *args)
        )

    # The rollout and reference workers hold no training state, so Ray may restart them after a crash
    # and re-run the interrupted call there (the flow then re-syncs a restarted rollout's weights);
    # the actor and critic resume from checkpoints instead. A rank of a group cannot rejoin its process
    # group, so with several ranks no training role restarts.
    arr = cfg.actor_rollout_ref
    training = {"actor": (actor_worker_class(cfg), arr.actor.resources)}
    if cfg.use_reference:
        training["ref"] = (ReferenceWorker, arr.ref.resources)
    if cfg.use_critic:
        training["critic"] = (CriticWorker, cfg.critic.resources)
    ranks, placement_groups = cfg.data_parallel_size, []
    if ranks == 1:
        groups = {
            role: [actor_of(cls, resources, restartable=role == "ref")] for role, (cls, resources) in training.items()
        }
    else:
        groups, placement_group = _start_training_ranks(training, ranks, actor_of)
        placement_groups.append(placement_group)
    handles = {}
    service = None
    if arr.rollout.mode == "async":
        service = _start_rollout_service(cfg, lambda cls: actor_of(cls, arr.rollout.resources, restartable=True))
    elif not cfg.colocated:
        handles["rollout"] = actor_of(rollout_worker_class(cfg), arr.rollout.resources, restartable=True)
    service_handles = service.replicas + service.agents if service else []
    every_handle = [*handles.values(), *(handle for group in groups.values() for handle in group), *service_handles]
    ray.get([handle.__ray_ready__.remote() for handle in every_handle])  # surfaces constructor errors
    backend = cfg.actor_rollout_ref.rollout.weight_sync.backend
    if backend != "object_store":  # the actor's rank 0 and the rollout (rank 1) share a collective group
        group = f"ppoflow-weights-{uuid.uuid4().hex[:12]}"
        ray.get(
            [
                *(rank.join_weight_group.remote(group) for rank in groups["actor"]),
                handles["rollout"].join_weight_group.remote(group),
            ]
        )
    roles_served = {
        role: RayRole(group[0]) if len(group) == 1 else RayGroupRole(group) for role, group in groups.items()
    }
    roles_served.update({role: RayRole(handle) for role, handle in handles.items()})
    if cfg.colocated:
        roles_served["rollout"] = roles_served["actor"]
    if service is not None:
        roles_served["rollout"] = service
    placement = {role: _node_ids(group) for role, group in groups.items()}
    if service is not None:
        placement["rollout"] = _node_ids(service.replicas)
    elif "rollout" in handles:
        placement["rollout"] = _node_ids([handles["rollout"]])
    return Workers(
        **roles_served,
        colocated=cfg.colocated,
        streams_reward=streams_reward(cfg),
        uses_ray=True,
        started_ray=started_ray,
        placement=placement,
        _handles=every_handle,
        _placement_groups=placement_groups,
    )


PLACEMENT_TIMEOUT_S = 60.0
"""How long the training ranks' placement group may wait for room before the run fails, naming what it asked."""


def _start_training_ranks(training: dict, ranks: int, actor_of) -> tuple[dict[str, list], object]:
    """W ranks of every training role in one placement group of W bundles (bundle i: rank i of each role,
    packed onto as few nodes as fit), each role's ranks joined in a process group of their own; the actors
    by role, and the placement group (removed at shutdown)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ppoflow.workers.data_parallel import RankInfo, free_port

    per_rank: dict[str, float] = {}
    for _, resources in training.values():
        for name, amount in _ray_resources(resources).items():
            per_rank[name] = per_rank.get(name, 0.0) + amount
    group = placement_group([dict(per_rank) for _ in range(ranks)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        offered = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        raise ConfigError(
            [
                (
                    "trainer.nnodes",
                    f"{ranks} training ranks (trainer.nnodes x ranks per node), each "
                    f"reserving {per_rank} for {', '.join(training)}, do not fit in the Ray "
                    f"cluster within {PLACEMENT_TIMEOUT_S:g} s; its nodes offer {offered}",
                )
            ]
        )

    def in_bundle(index: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}

    started = {}
    for role, (cls, resources) in training.items():
        address, port = ray.get(ray.remote(free_port).options(num_cpus=0, **in_bundle(0)).remote())
        started[role] = [
            actor_of(cls, resources, RankInfo(rank, ranks, address, port), **in_bundle(rank)) for rank in range(ranks)
        ]
    return started, group


def _node_ids(handles: list) -> list[str]:
    """The Ray node each actor runs on (rank order)."""
    import ray

    return ray.get(
        [handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for handle in handles]
    )


def streams_reward(cfg: PPOConfig) -> bool:
    """Whether the rollout scores trajectories as they finish: the rollout service does, unless the scoring
    fans out over Ray as a stage of its own (``reward_model.reward_manager=ray``)."""
    return cfg.actor_rollout_ref.rollout.mode == "async" and cfg.reward_model.reward_manager == "naive"


def _start_rollout_service(cfg: PPOConfig, replica_of):
    """``rollout.mode=async``: ``num_replicas`` generation replicas (restartable, on rollout.resources) and
    ``agent.num_workers`` agent-loop workers (asyncio actors that reserve no CPU) that call them."""
    import ray

    from ppoflow.workers.models import load_tokenizer
    from ppoflow.workers.rollout_service import AgentLoopWorker, RolloutReplica, RolloutService

    rollout = cfg.actor_rollout_ref.rollout
    replicas = [replica_of(RolloutReplica) for _ in range(rollout.num_replicas)]
    agents = [
        ray.remote(AgentLoopWorker).options(num_cpus=0, runtime_env={"env_vars": worker_env()}).remote(cfg, replicas)
        for _ in range(rollout.agent.num_workers)
    ]
    return RolloutService(replicas, agents, pad_token_id=load_tokenizer(cfg.actor_rollout_ref.model).pad_token_id)


def start_local_workers(cfg: PPOConfig) -> Workers:
    """The same roles as plain in-process objects (no Ray): the baseline of the overhead benchmark."""
    from ppoflow.workers.critic import CriticWorker
    from ppoflow.workers.policy import ReferenceWorker

    if cfg.actor_rollout_ref.rollout.mode == "async":
        raise ValueError("actor_rollout_ref.rollout.mode=async serves generation from Ray actors; it needs Ray")
    if cfg.data_parallel_size > 1:
        raise ValueError(f"{cfg.data_parallel_size} data-parallel ranks per training role need Ray")
    actor = LocalRole(actor_worker_class(cfg)(cfg))
    return Workers(
        rollout=actor if cfg.colocated else LocalRole(rollout_worker_class(cfg)(cfg)),
        actor=actor,
        ref=LocalRole(ReferenceWorker(cfg)) if cfg.use_reference else None,
        critic=LocalRole(CriticWorker(cfg)) if cfg.use_critic else None,
        colocated=cfg.colocated,
        uses_ray=False,
    )


def scoring_cpus(cfg: PPOConfig) -> int:
    """CPUs the reward stage's Ray tasks use at once (``reward_model.reward_manager=ray``: one per chunk)."""
    return cfg.reward_model.num_workers if cfg.reward_model.reward_manager == "ray" else 0


def _connect_ray(cfg: PPOConfig, roles: dict[str, ResourcesConfig]) -> bool:
    """Join ``ray.address`` / ``RAY_ADDRESS``, reuse a running Ray, or start a local one; True if started."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env={"env_vars": worker_env()}, log_to_driver=True)
        return False
    needed = sum(resources.num_cpus for resources in roles.values()) + scoring_cpus(cfg)
    num_cpus = cfg.ray.num_cpus or max(os.cpu_count() or 1, math.ceil(needed))
    # address="local": a Ray of this run's own, even when a cluster started with `ray start` runs on this
    # machine (joining one is what ray.address is for)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=_local_gpu_count(),
        include_dashboard=False,
        runtime_env={"env_vars": worker_env()},
        log_to_driver=True,
    )
    return True


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


_RESOURCE_KEYS = {"CPU": "num_cpus", "GPU": "num_gpus"}
"""How the config names a Ray resource of a role (a custom one is ``custom.<name>``)."""


def _check_fits(roles: dict[str, ResourcesConfig], *, scores_on_ray: bool) -> None:
    """Fail now, with a :class:`ConfigError` naming the key of the role that asks most, rather than leave
    an actor or a scoring task pending forever: CPUs, GPUs and every custom resource the roles reserve,
    against the whole Ray cluster.

    Scoring on Ray needs one CPU beyond the actors' so that at least one chunk runs."""
    import ray

    available = ray.cluster_resources()
    wanted = {name for resources in roles.values() for name in _ray_resources(resources)} | {"CPU"}
    for unit in sorted(wanted):
        needed = sum(_ray_resources(resources).get(unit, 0.0) for resources in roles.values())
        details = [f"{key}: {_ray_resources(resources).get(unit, 0.0):g}" for key, resources in roles.items()]
        if unit == "CPU" and scores_on_ray:
            needed += 1
            details.append("1 for reward_model.reward_manager=ray")
        if needed > available.get(unit, 0):
            largest = max(roles, key=lambda key: _ray_resources(roles[key]).get(unit, 0.0)).split(" (")[0]
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
