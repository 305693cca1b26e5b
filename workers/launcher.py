"""Starting the run's workers: joining (or starting) Ray, checking the roles fit, starting every role's actors
(one per data-parallel rank in a placement group for a training role, :mod:`ppoflow.workers.training.data_parallel`;
the rollout service's replicas and agent-loop workers with ``rollout.mode=async``) and the environment they get;
:func:`start_local_workers` builds the same roles as plain objects in this process (the overhead benchmark's
baseline). Ray's own calls for the layers above (the preflight's handshake, the shutdown after a signal) live here
too, so that only workers/ imports Ray. Details: docs/architecture.md#workers.
"""

from __future__ import annotations

import logging
import math
import os
import uuid

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig, ResourcesConfig
from ppoflow.workers.resources import check_fits, ray_resources, role_resources, scoring_cpus
from ppoflow.workers.roles import ActorBaseRole, LocalRole, RayGroupRole, RayObjects, RayRole, Workers
from ppoflow.workers.transport import send_batches_as_plain_values

logger = logging.getLogger(__name__)

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


JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
"""jemalloc as the workers run it: every page a process frees stays with it for reuse. An update frees and
allocates the same gradients and intermediates each micro-batch; pages handed back as they cool would be faulted
in again (docs/benchmarks.md). They go back at each stage's end instead (:mod:`ppoflow.workers.stage`)."""


def allocator_env(allocator: str) -> dict[str, str]:
    """The environment that makes a local Ray's workers run ``ray.worker_allocator``. ``jemalloc``: the build Ray
    ships, and runs its GCS and raylet with, preloaded with :data:`JEMALLOC_CONF`; the driver's own LD_PRELOAD or
    MALLOC_CONF, where set, wins (the workers inherit it). ``system``, or no jemalloc in Ray's wheel (not Linux):
    nothing, the C library's malloc."""
    import ray

    if allocator != "jemalloc" or "LD_PRELOAD" in os.environ:
        return {}
    library = os.path.join(os.path.dirname(ray.__file__), "core", "libjemalloc.so")
    if not os.path.exists(library):
        logger.warning("ray.worker_allocator=jemalloc: Ray ships none here (no %s); workers use malloc", library)
        return {}
    return {"LD_PRELOAD": library, "MALLOC_CONF": os.environ.get("MALLOC_CONF", JEMALLOC_CONF)}


RESTARTS = 3
"""How often Ray restarts a crashed stateless worker (rollout, reference) before the run fails."""


def rollout_worker_class(cfg: PPOConfig) -> type:
    """The generation engine ``actor_rollout_ref.rollout.name`` selects (vLLM is imported only when it runs)."""
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        from ppoflow.workers.rollout.vllm_worker import VLLMRolloutWorker

        return VLLMRolloutWorker
    from ppoflow.workers.rollout.hf_worker import HFRolloutWorker

    return HFRolloutWorker


def actor_worker_class(cfg: PPOConfig) -> type:
    """The actor's worker: one that also generates when the rollout is colocated with it."""
    from ppoflow.workers.training.colocated import ColocatedActorWorker
    from ppoflow.workers.training.policy import ActorWorker

    return ColocatedActorWorker if cfg.colocated else ActorWorker


def reward_model_worker_class() -> type:
    """The reward model's worker (imported only when a run has one)."""
    from ppoflow.workers.reward_model import RewardModelWorker

    return RewardModelWorker


def start_workers(cfg: PPOConfig) -> Workers:
    """Join (or start) Ray, check the roles fit, start the actors of every role and wait until all loaded."""
    import ray

    from ppoflow.workers.training.colocated import ColocatedActorWorker
    from ppoflow.workers.training.critic import CriticWorker
    from ppoflow.workers.training.policy import ReferenceWorker

    roles = role_resources(cfg)
    started_ray = _connect_ray(cfg, roles)
    send_batches_as_plain_values()
    check_fits(roles, scores_on_ray=scoring_cpus(cfg) > 0)
    objects = RayObjects()
    handles = {}

    def actor_of(cls, resources: ResourcesConfig, *args, restartable: bool = False, **options):
        env = {**worker_env(), "OMP_NUM_THREADS": str(resources.num_threads)}
        groups = {}
        if cls is ColocatedActorWorker:  # its engine's requests wait on threads beside the training calls
            groups = {cls.SERVING: cfg.actor_rollout_ref.rollout.max_num_seqs}
        return (
            ray.remote(concurrency_groups=groups)(cls)
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
    if cfg.use_reference and not cfg.ref_in_actor:
        training["ref"] = (ReferenceWorker, arr.ref.resources)
    if cfg.use_critic:
        training["critic"] = (CriticWorker, cfg.critic.resources)
    if cfg.reward_model.enable:  # stateless, like the reference: restartable
        handles["reward_model"] = actor_of(reward_model_worker_class(), cfg.reward_model.resources, restartable=True)
    ranks, placement_groups = cfg.data_parallel_size, []
    if ranks == 1:
        groups = {
            role: [actor_of(cls, resources, restartable=role == "ref")] for role, (cls, resources) in training.items()
        }
    else:
        groups, placement_group = _start_training_ranks(training, ranks, actor_of)
        placement_groups.append(placement_group)
    service = None
    if arr.rollout.mode == "async":
        service = _start_rollout_service(cfg, actor_of, objects, ranks=groups["actor"] if cfg.colocated else None)
    elif not cfg.colocated:
        handles["rollout"] = actor_of(rollout_worker_class(cfg), arr.rollout.resources, restartable=True)
    service_handles = service.judge_replicas + service.agents if service else []
    if service is not None and not cfg.colocated:
        service_handles += service.replicas
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
        role: RayRole(group[0], objects) if len(group) == 1 else RayGroupRole(group, objects)
        for role, group in groups.items()
    }
    roles_served.update({role: RayRole(handle, objects) for role, handle in handles.items()})
    if cfg.ref_in_actor:
        roles_served["ref"] = ActorBaseRole(roles_served["actor"])
    if cfg.colocated:
        roles_served["rollout"] = roles_served["actor"]
    if service is not None:
        roles_served["rollout"] = service
    placement = {role: _node_ids(group) for role, group in groups.items()}
    if service is not None and not cfg.colocated:  # colocated, the replicas are the actor's ranks
        placement["rollout"] = _node_ids(service.replicas)
    if service is not None and service.judge_replicas:
        placement["judge"] = _node_ids(service.judge_replicas)
    placement.update({role: _node_ids([handle]) for role, handle in handles.items()})
    return Workers(
        **roles_served,
        colocated=cfg.colocated,
        streams_reward=streams_reward(cfg),
        uses_ray=True,
        started_ray=started_ray,
        placement=placement,
        objects=objects,
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

    from ppoflow.workers.training.data_parallel import RankInfo, free_port

    per_rank: dict[str, float] = {}
    for _, resources in training.values():
        for name, amount in ray_resources(resources).items():
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
    fans out over Ray as a stage of its own (``reward_model.reward_manager=ray``) or a reward model or service
    scores the batch in the reward_model stage."""
    rewards = cfg.reward_model
    scored_apart = rewards.reward_manager == "ray" or rewards.model_stage
    return cfg.actor_rollout_ref.rollout.mode == "async" and not scored_apart


def _start_rollout_service(cfg: PPOConfig, actor_of, objects: RayObjects, *, ranks: list | None = None):
    """``rollout.mode=async``: ``num_replicas`` generation replicas (restartable, on rollout.resources), or the
    actor's ``ranks`` when the rollout is colocated with it; the judge model's replicas when it has one (on
    ``reward_model.judge.resources``), and ``agent.num_workers`` agent-loop workers (asyncio actors that reserve
    no CPU) that call them."""
    import secrets

    import ray

    from ppoflow.workers.models import load_tokenizer
    from ppoflow.workers.service.agent_worker import AgentLoopWorker
    from ppoflow.workers.service.replicas import JudgeReplica, RolloutReplica
    from ppoflow.workers.service.rollout_service import ColocatedRolloutService, RolloutService

    rollout, judge = cfg.actor_rollout_ref.rollout, cfg.reward_model.judge
    replicas = ranks or [
        actor_of(RolloutReplica, rollout.resources, restartable=True) for _ in range(rollout.num_replicas)
    ]
    judges = []
    if cfg.judge_model is not None:
        judges = [actor_of(JudgeReplica, judge.resources, restartable=True) for _ in range(judge.num_replicas)]
    gateway_token = secrets.token_urlsafe(32)  # the run's bearer token for every worker's gateway
    agents = [
        ray.remote(AgentLoopWorker)
        .options(num_cpus=0, runtime_env={"env_vars": worker_env()})
        .remote(cfg, replicas, judge_replicas=judges, gateway_token=gateway_token)
        for _ in range(rollout.agent.num_workers)
    ]
    pad_token_id = load_tokenizer(cfg.actor_rollout_ref.model).pad_token_id
    service = ColocatedRolloutService if ranks else RolloutService
    return service(replicas, agents, pad_token_id=pad_token_id, objects=objects, judge_replicas=judges)


def start_local_workers(cfg: PPOConfig) -> Workers:
    """The same roles as plain in-process objects (no Ray): the baseline of the overhead benchmark."""
    from ppoflow.workers.training.critic import CriticWorker
    from ppoflow.workers.training.policy import ReferenceWorker

    if cfg.actor_rollout_ref.rollout.mode == "async":
        raise ValueError("actor_rollout_ref.rollout.mode=async serves generation from Ray actors; it needs Ray")
    if cfg.data_parallel_size > 1:
        raise ValueError(f"{cfg.data_parallel_size} data-parallel ranks per training role need Ray")
    actor = LocalRole(actor_worker_class(cfg)(cfg))
    ref = None
    if cfg.use_reference:
        ref = ActorBaseRole(actor) if cfg.ref_in_actor else LocalRole(ReferenceWorker(cfg))
    return Workers(
        rollout=actor if cfg.colocated else LocalRole(rollout_worker_class(cfg)(cfg)),
        actor=actor,
        ref=ref,
        critic=LocalRole(CriticWorker(cfg)) if cfg.use_critic else None,
        reward_model=LocalRole(reward_model_worker_class()(cfg)) if cfg.reward_model.enable else None,
        colocated=cfg.colocated,
        uses_ray=False,
    )


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
        runtime_env={"env_vars": worker_env() | allocator_env(cfg.ray.worker_allocator)},
        log_to_driver=True,
        _system_config={"worker_niceness": cfg.ray.worker_niceness},
    )
    return True


def _local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def shutdown_ray() -> None:
    """Stop this process's Ray (its workers and, when it started one, the local cluster); nothing when none runs."""
    import ray

    ray.shutdown()


def ray_handshake(target: str, *, client: bool, timeout_s: float) -> str | None:
    """Why ``target`` (host:port) did not answer Ray's handshake within ``timeout_s`` (None when it did), without
    starting Ray here: the GCS's ``GetClusterId`` call, the first one ``ray.init`` makes, or with ``client`` the
    Ray client server's ping; gRPC calls honour their deadline."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        try:
            if client:
                from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

                request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(request, timeout=timeout_s)
            else:
                from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                    gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s
                )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                return None  # a Ray cluster with token authentication: it answered, ray.init brings the token
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer to Ray's handshake within {timeout_s:g} s"
            return f"{error.code().name}: {error.details()}"
    return None
