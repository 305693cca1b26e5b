"""The config rules of resources: the training roles' ranks and what they reserve, and the two pools
(training, rollout) they are placed on; part of :func:`ppoflow.configs.rules.cross_field_errors`."""

from __future__ import annotations

from ppoflow.configs.schema import PPOConfig


def _ranks_text(cfg: PPOConfig) -> str:
    """How ``PPOConfig.data_parallel_size`` came about, e.g.
    ``W = 2 from trainer.nnodes=1 x trainer.n_gpus_per_node=2``."""
    trainer = cfg.trainer
    per_node = (
        f"trainer.n_gpus_per_node={trainer.n_gpus_per_node}"
        if trainer.n_gpus_per_node > 0
        else f"trainer.n_cpu_ranks_per_node={trainer.n_cpu_ranks_per_node}"
    )
    return f"W = {cfg.data_parallel_size} from trainer.nnodes={trainer.nnodes} x {per_node}"


def data_parallel_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """What running each training role as W = ``data_parallel_size`` ranks needs: mini-batches that split evenly over
    the ranks, and offloading only from GPUs."""
    errors: list[tuple[str, str]] = []
    arr, ranks = cfg.actor_rollout_ref, cfg.data_parallel_size
    minis = {"actor_rollout_ref.actor.ppo_mini_batch_size": arr.actor.ppo_mini_batch_size}
    if cfg.use_critic:
        minis["critic.ppo_mini_batch_size"] = cfg.critic.ppo_mini_batch_size
    for key, prompts in minis.items():
        trajectories = prompts * arr.rollout.n
        if trajectories % ranks:
            errors.append(
                (
                    key,
                    f"mini-batches of {prompts} x rollout.n={arr.rollout.n} = {trajectories} trajectories "
                    f"cannot be split evenly over {ranks} training ranks ({_ranks_text(cfg)})",
                )
            )
    if cfg.trainer.n_gpus_per_node == 0:
        roles = {"actor_rollout_ref.actor": arr.actor}
        if cfg.use_reference:
            roles["actor_rollout_ref.ref"] = arr.ref
        if cfg.use_critic:
            roles["critic"] = cfg.critic
        for key, role in roles.items():
            if role.fsdp_config.offload_policy:
                errors.append(
                    (
                        f"{key}.fsdp_config.offload_policy",
                        "offloading moves GPU memory to the CPU, but the "
                        "training pool is on CPUs (trainer.n_gpus_per_node=0); set offload_policy=false",
                    )
                )
    return errors


def resource_errors(cfg: PPOConfig) -> list[tuple[str, str]]:
    """verl's pool rules: training roles fit the trainer pool, a rollout that is not colocated fits its own pool."""
    errors: list[tuple[str, str]] = []
    arr = cfg.actor_rollout_ref
    trainer_gpus = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    rollout_gpus = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    training_roles = {"actor_rollout_ref.actor": arr.actor.resources}
    if cfg.use_reference and not cfg.ref_in_actor:
        training_roles["actor_rollout_ref.ref"] = arr.ref.resources
    if cfg.use_critic:
        training_roles["critic"] = cfg.critic.resources
    ranks = cfg.data_parallel_size  # every training role runs as this many ranks, each reserving its resources
    wanted = ranks * sum(resources.num_gpus for resources in training_roles.values())
    if wanted > trainer_gpus:
        errors.append(
            (
                "trainer.n_gpus_per_node",
                f"the training roles reserve {wanted:g} GPUs ({ranks} rank"
                f"{'s' if ranks > 1 else ''} x "
                f"({' + '.join(f'{k}.resources.num_gpus={r.num_gpus:g}' for k, r in training_roles.items())})) "
                f"but the training pool has trainer.nnodes * trainer.n_gpus_per_node = {trainer_gpus}",
            )
        )
    replicas = arr.rollout.num_replicas if arr.rollout.mode == "async" else 1  # each on rollout.resources
    if not cfg.colocated and replicas * arr.rollout.resources.num_gpus > rollout_gpus:  # colocated: the actor's
        reserved = f"actor_rollout_ref.rollout.resources.num_gpus={arr.rollout.resources.num_gpus:g}"
        if replicas > 1:
            reserved = (
                f"rollout.mode=async: num_replicas={replicas} x {reserved} = "
                f"{replicas * arr.rollout.resources.num_gpus:g} GPUs"
            )
        errors.append(
            (
                "rollout.n_gpus_per_node",
                f"{reserved} exceeds the rollout pool rollout.nnodes * rollout.n_gpus_per_node = {rollout_gpus}",
            )
        )
    if trainer_gpus and trainer_gpus % arr.rollout.n and (arr.rollout.n * cfg.data.train_batch_size) % trainer_gpus:
        errors.append(
            (
                "actor_rollout_ref.rollout.n",
                f"with {trainer_gpus} training GPUs, rollout.n={arr.rollout.n} "
                "must divide the GPU count, or rollout.n * data.train_batch_size must be divisible by it",
            )
        )
    if arr.rollout.weight_sync.backend == "nccl" and not (
        arr.actor.resources.num_gpus and arr.rollout.resources.num_gpus
    ):
        errors.append(
            (
                "actor_rollout_ref.rollout.weight_sync.backend",
                "nccl moves weights between GPUs; the actor and the rollout both need resources.num_gpus > 0 "
                "(use object_store or gloo on CPUs)",
            )
        )
    return errors
