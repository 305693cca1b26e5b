"""Cross-field rules of the config: batch divisibility, the critic and reference, data-parallel ranks and the
colocated layout, resources and pools, rollout correction, resume; each problem names the key to change."""

from __future__ import annotations

import pytest

from ppoflow.configs import load_config
from tests.config_helpers import only_problem, problems_of

# ------------------------------------------------------------------------- cross-field rules


@pytest.mark.parametrize(
    "overrides, key, message",
    [
        (
            ["actor_rollout_ref.actor.ppo_mini_batch_size=3"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "data.train_batch_size * rollout.n = 128 trajectories is not divisible by "
            "ppo_mini_batch_size * rollout.n = 24",
        ),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=7"],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "7 does not divide the mini-batch of 128 trajectories",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
            "critic.ppo_mini_batch_size",
            "128 trajectories per step are not divisible by critic mini-batch 24",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=48"],
            "critic.ppo_micro_batch_size_per_gpu",
            "48 does not divide the critic mini-batch of 128",
        ),
        (
            ["data.gen_batch_size=32"],
            "data.gen_batch_size",
            "32 != data.train_batch_size 16: only dynamic sampling (algorithm.filter_groups.enable=true) generates "
            "more prompts than are trained on; leave it null",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.enable=false"],
            "critic.enable",
            "algorithm.adv_estimator=gae needs a critic; set critic.enable=true or null",
        ),
        (
            ["actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.rollout.n",
            "algorithm.adv_estimator=grpo compares responses of one prompt and needs n >= 2, got 1",
        ),
        (
            ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.rollout.n",
            "algorithm.adv_estimator=rloo compares responses of one prompt and needs n >= 2, got 1",
        ),
        (
            ["algorithm.kl_penalty=k4"],
            "algorithm.kl_penalty",
            "Input should be 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3', 'kl+', 'k1+', 'abs+', 'mse+', 'k2+', "
            "'low_var_kl+' or 'k3+' (got 'k4')",
        ),
        (
            ["actor_rollout_ref.actor.kl_loss_type=full"],
            "actor_rollout_ref.actor.kl_loss_type",
            "Input should be 'kl', 'k1', 'abs', 'mse', 'k2', 'low_var_kl', 'k3', 'kl+', 'k1+', 'abs+', 'mse+', 'k2+', "
            "'low_var_kl+' or 'k3+' (got 'full')",
        ),
        (["data.val_files=null"], "data.val_files", "trainer.test_freq=20 needs validation files"),
        (["skip.rollout.enable=true"], "skip.rollout.steps", "caching is enabled but no step is listed"),
        (
            ["skip.reward.enable=true", "skip.reward.steps=[]"],
            "skip.reward.steps",
            "caching is enabled but no step is listed",
        ),
        (["skip.ref.enable=true", "skip.ref.steps=[1]"], "skip.ref.enable", "this run has no ref stage to cache"),
        # data-parallel training: W = trainer.nnodes x (n_gpus_per_node, or n_cpu_ranks_per_node on CPUs) ranks per role
        (
            ["trainer.n_cpu_ranks_per_node=0"],
            "trainer.n_cpu_ranks_per_node",
            "Input should be greater than or equal to 1 (got 0)",
        ),
        (
            ["trainer.nnodes=3", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "mini-batches of 4 x rollout.n=8 = 32 trajectories cannot be split evenly over 3 training ranks "
            "(W = 3 from trainer.nnodes=3 x trainer.n_cpu_ranks_per_node=1)",
        ),
        (
            [
                "trainer.n_cpu_ranks_per_node=3",
                "algorithm.adv_estimator=gae",
                "actor_rollout_ref.rollout.n=1",
                "data.train_batch_size=12",
                "actor_rollout_ref.actor.ppo_mini_batch_size=6",
                "critic.ppo_mini_batch_size=4",
            ],
            "critic.ppo_mini_batch_size",
            "mini-batches of 4 x rollout.n=1 = 4 trajectories cannot be split evenly over 3 "
            "training ranks (W = 3 from trainer.nnodes=1 x trainer.n_cpu_ranks_per_node=3)",
        ),
        (
            ["actor_rollout_ref.actor.fsdp_config.offload_policy=true"],
            "actor_rollout_ref.actor.fsdp_config.offload_policy",
            "offloading moves GPU memory to the CPU, but the training pool is on CPUs (trainer.n_gpus_per_node=0); set "
            "offload_policy=false",
        ),
        (
            ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.ref.fsdp_config.offload_policy=true"],
            "actor_rollout_ref.ref.fsdp_config.offload_policy",
            "offloading moves GPU memory to the CPU, but the training pool is on CPUs (trainer.n_gpus_per_node=0); set "
            "offload_policy=false",
        ),
        (
            ["actor_rollout_ref.actor.resources.custom={trainer_node: -1}"],
            "actor_rollout_ref.actor.resources.custom",
            "each amount must be >= 0 (got {'trainer_node': -1})",
        ),
        (["critic.strategy=megatron"], "critic.strategy", "Input should be 'fsdp2' (got 'megatron')"),
    ],
)
def test_cross_field_rules(overrides, key, message):
    assert only_problem(overrides) == (key, message)


def test_cross_field_rules_hold_when_the_values_fit():
    # 16 prompts x 8 = 128 trajectories; mini-batch 4 x 8 = 32 divides it; micro 16 divides 32
    cfg = load_config(
        "grpo_tiny",
        [
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "data.gen_batch_size=16",
            "algorithm.kl_penalty=low_var_kl+",
            "data.val_files=null",
            "trainer.test_freq=0",
            "skip.rollout.enable=true",
            "skip.rollout.steps=[1]",
        ],
    )
    assert cfg.gen_batch_size == 16 and cfg.data.val_files is None
    # the critic rules are not checked when no critic runs
    load_config("grpo_tiny", ["critic.ppo_mini_batch_size=3"])


def test_data_parallel_size_and_the_colocated_layout():
    demo = load_config("grpo_tiny")
    assert demo.data_parallel_size == 1 and demo.colocated is True
    assert demo.actor_rollout_ref.actor.strategy == "fsdp2" and demo.critic.fsdp_config.reshard_after_forward is True
    assert demo.actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype is None
    assert demo.actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype == "float32"
    assert demo.actor_rollout_ref.rollout.resources.custom == {}
    # on CPUs: nnodes x n_cpu_ranks_per_node; null resolves to verl's layout, every rank colocated
    cpus = load_config("grpo_tiny", ["trainer.nnodes=2", "trainer.n_cpu_ranks_per_node=2"])
    assert cpus.data_parallel_size == 4 and cpus.colocated is True
    # on GPUs n_cpu_ranks_per_node is unused: nnodes x n_gpus_per_node
    gpus = load_config(
        "grpo_tiny",
        [
            "trainer.n_gpus_per_node=2",
            "trainer.n_cpu_ranks_per_node=4",
            "actor_rollout_ref.actor.resources.num_gpus=1",
            "actor_rollout_ref.rollout.resources.num_gpus=1",
            "rollout.n_gpus_per_node=1",
        ],
    )
    assert gpus.data_parallel_size == 2 and gpus.colocated is True
    assert (
        load_config("grpo_tiny", ["trainer.n_cpu_ranks_per_node=2", "actor_rollout_ref.hybrid_engine=false"]).colocated
        is False
    )
    # offloading is allowed from GPUs; custom resources take YAML ints and floats
    offload = load_config(
        "grpo_tiny",
        [
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.resources.num_gpus=1",
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
            "actor_rollout_ref.actor.resources.custom={trainer_node: 1, other: 0.5}",
        ],
    )
    assert offload.actor_rollout_ref.actor.resources.custom == {"trainer_node": 1.0, "other": 0.5}


@pytest.mark.parametrize("preset", ["grpo_tiny", "vault_tool", "ppo_trainer"])
def test_shipped_presets_are_one_rank_per_role(preset):
    from ppoflow.configs.rules_resources import data_parallel_errors

    cfg = load_config(
        preset, [] if preset != "ppo_trainer" else ["actor_rollout_ref.model.path=/m", "data.train_files=/t.parquet"]
    )
    assert cfg.data_parallel_size == 1 and data_parallel_errors(cfg) == []


def test_several_cross_field_problems_at_once():
    problems = problems_of("grpo_tiny", ["actor_rollout_ref.rollout.n=1", "data.gen_batch_size=32"])
    assert [key for key, _ in problems] == ["actor_rollout_ref.rollout.n", "data.gen_batch_size"]


def test_unknown_loggers_are_refused_by_the_schema():
    assert only_problem(["trainer.logger=[console,swanlab,clearml]"]) == (
        "trainer.logger",
        "unknown logger 'swanlab', 'clearml'; choose from console, tensorboard, wandb, mlflow, file, trackio "
        "(got ['console', 'swanlab', 'clearml'])",
    )
    cfg = load_config("grpo_tiny", ["trainer.logger=[console,tensorboard,wandb,mlflow,file,trackio]"])
    assert cfg.trainer.logger == ["console", "tensorboard", "wandb", "mlflow", "file", "trackio"]


# --------------------------------------------------------- resources, rollout correction, resume


@pytest.mark.parametrize(
    "words, key, message",
    [
        (
            ["actor_rollout_ref.actor.resources.num_gpus=1"],
            "trainer.n_gpus_per_node",
            "the training roles reserve 1 GPUs (1 rank x (actor_rollout_ref.actor.resources.num_gpus=1)) but "
            "the training pool has trainer.nnodes * trainer.n_gpus_per_node = 0",
        ),
        # each of the W ranks of a training role reserves the role's GPUs
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.resources.num_gpus=1",
                "actor_rollout_ref.actor.use_kl_loss=true",
                "actor_rollout_ref.ref.resources.num_gpus=0.5",
            ],
            "trainer.n_gpus_per_node",
            "the training roles reserve 3 GPUs (2 ranks x (actor_rollout_ref.actor.resources."
            "num_gpus=1 + actor_rollout_ref.ref.resources.num_gpus=0.5)) but the training pool has "
            "trainer.nnodes * trainer.n_gpus_per_node = 2",
        ),
        (
            ["actor_rollout_ref.rollout.resources.num_gpus=1"],
            "rollout.n_gpus_per_node",
            "actor_rollout_ref.rollout.resources.num_gpus=1 exceeds the rollout pool "
            "rollout.nnodes * rollout.n_gpus_per_node = 0",
        ),
        (
            [
                "trainer.mode=one_step_off",
                "rollout.n_gpus_per_node=1",
                "actor_rollout_ref.rollout.resources.num_gpus=1",
            ],
            "rollout.n_gpus_per_node",
            "one_step_off needs both pools on GPUs or both on CPUs (training pool 0 GPUs, rollout pool 1)",
        ),
        (
            ["actor_rollout_ref.rollout.weight_sync.backend=nccl"],
            "actor_rollout_ref.rollout.weight_sync.backend",
            "nccl moves weights between GPUs; the actor and the rollout both need resources.num_gpus > 0 "
            "(use object_store or gloo on CPUs)",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold='3_1'",
            ],
            "algorithm.rollout_correction.rollout_is_threshold",
            "Invalid threshold '3_1': the lower bound exceeds the upper bound.",
        ),
        (
            ["algorithm.rollout_correction.rollout_rs=token_k2"],
            "algorithm.rollout_correction.rollout_rs_threshold",
            "rollout_rs='token_k2' needs thresholds",
        ),
        # a problem of the options names rollout_rs, one of their bounds rollout_rs_threshold
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k9",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0",
            ],
            "algorithm.rollout_correction.rollout_rs",
            "Unknown rollout rejection option 'token_k9'",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2,seq_max_k3",
                "algorithm.rollout_correction.rollout_rs_threshold=[1.0,2.0,3.0]",
            ],
            "algorithm.rollout_correction.rollout_rs_threshold",
            "rollout rejection: got 3 thresholds for 2 options",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=sequence"],
            "algorithm.rollout_correction.bypass_mode",
            "bypass mode with rollout_is / rollout_rs is not supported yet: verl then weights and masks the loss by "
            "the current policy against the rollout's",
        ),
        (
            ["trainer.resume_mode=resume_path", "trainer.resume_from_path=somewhere"],
            "trainer.resume_from_path",
            "resume_mode=resume_path needs a .../global_step_N directory",
        ),
    ],
)
def test_resource_correction_and_resume_rules(words, key, message):
    problem_key, problem = only_problem(words)
    assert problem_key == key and problem.startswith(message)


def test_verl_pool_rule_and_the_mini_batch_split_both_report_indivisible_batches():
    # 3 x 3 = 9 trajectories neither fill 4 GPUs evenly (verl's pool rule) nor split over 4 ranks
    assert problems_of(
        "grpo_tiny",
        [
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.rollout.n=3",
            "data.train_batch_size=3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        ],
    ) == [
        (
            "actor_rollout_ref.rollout.n",
            "with 4 training GPUs, rollout.n=3 must divide the GPU count, or rollout.n * "
            "data.train_batch_size must be divisible by it",
        ),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "mini-batches of 3 x rollout.n=3 = 9 trajectories cannot be "
            "split evenly over 4 training ranks (W = 4 from trainer.nnodes=1 x trainer.n_gpus_per_node=4)",
        ),
    ]


def test_verl_pool_rule_accepts_divisible_batches():
    cfg = load_config("grpo_tiny", ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.resources.num_gpus=1"])
    assert cfg.trainer.n_gpus_per_node == 4  # 8 responses per prompt divide 4 GPUs


def test_the_rollout_dtype_left_null_fits_the_hardware(monkeypatch):
    """bfloat16 on GPUs (verl's default) and on a CPU with AMX; float32 on other CPUs, where bfloat16 samples up
    to twice as slow; a dtype that is set stays; the run's start says which, and the step cache keeps it."""
    from ppoflow.configs import normalize
    from ppoflow.flows.stages import RolloutOrigin

    gpu = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.resources.num_gpus=1"]
    for amx, on_cpu in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(normalize, "cpu_has_amx", lambda amx=amx: amx)
        assert load_config("grpo_tiny").actor_rollout_ref.rollout.dtype == on_cpu
        assert load_config("grpo_tiny", gpu).actor_rollout_ref.rollout.dtype == "bfloat16"
        set_by_hand = load_config("grpo_tiny", ["actor_rollout_ref.rollout.dtype=float16"])
        assert set_by_hand.actor_rollout_ref.rollout.dtype == "float16"
    cfg = load_config("grpo_tiny")  # no AMX, as monkeypatched last
    assert RolloutOrigin.of(cfg, None).dtype == "float32"  # a cached rollout of another dtype is not replayed
    assert normalize.rollout_dtype_line("float32", on_gpu=False) == (
        "the rollout samples in float32 (actor_rollout_ref.rollout.dtype) on this CPU (without AMX)"
    )
    assert normalize.rollout_dtype_line("bfloat16", on_gpu=False).endswith("; float32 samples faster on it")
