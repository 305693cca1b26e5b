"""The colocated layout (``actor_rollout_ref.hybrid_engine``): the actor's worker also generates, with the
model it trains, so weight_sync moves nothing; a run is the same as with a rollout worker of its own."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.modes import make_trainer
from ppoflow.flows.run import start_run
from ppoflow.flows.state import TrainerState
from ppoflow.flows.step import train_steps
from ppoflow.workers.resources import role_resources

STEP_METRICS = (
    "critic/score/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/entropy",
    "training/rollout_probs_diff_max",
)


def steps_in_process(cfg, steps: int, *, colocated: bool) -> list[dict[str, float]]:
    """``steps`` training steps with in-process workers (no Ray, no Prefect), laid out as ``colocated``
    says; each step's metrics."""
    run = start_run(cfg, orchestrated=False)
    assert run.workers.colocated is colocated and (run.workers.rollout is run.workers.actor) is colocated
    state = TrainerState(cfg, len(run.train_set))
    return [dict(step.metrics) for step in train_steps(run, state, make_trainer(run, state), range(1, steps + 1))]


@pytest.mark.parametrize(
    "words, colocated",
    [
        ([], True),  # sync, hf, object_store: colocated unless asked otherwise
        (["actor_rollout_ref.hybrid_engine=false"], False),
        (["trainer.mode=one_step_off"], False),  # generation overlaps training: a rollout worker of its own
        (["actor_rollout_ref.rollout.weight_sync.backend=gloo"], False),
    ],
)
def test_the_layout_follows_the_mode_unless_set(words, colocated):
    cfg = load_config("grpo_tiny", words)
    assert cfg.colocated is colocated
    assert ("actor_rollout_ref.rollout" in role_resources(cfg)) is not colocated


@pytest.mark.parametrize(
    "words, needle",
    [
        (["trainer.mode=one_step_off"], "trainer.mode=one_step_off generates while the actor trains"),
        (
            ["actor_rollout_ref.rollout.weight_sync.backend=gloo"],
            "weight_sync.backend=gloo sends weights between two workers",
        ),
    ],
)
def test_combinations_that_cannot_colocate_name_the_key(words, needle):
    with pytest.raises(ConfigError) as raised:
        load_config("grpo_tiny", ["actor_rollout_ref.hybrid_engine=true"] + words)
    ((key, message),) = raised.value.problems
    assert key == "actor_rollout_ref.hybrid_engine" and needle in message


def test_a_colocated_run_equals_one_with_a_rollout_worker_of_its_own(tiny_overrides):
    """The rollout samples with the actor's own model instead of a synced copy: the same samples, the same
    updates, step after step; weight_sync moves nothing."""
    in_bfloat16 = [*tiny_overrides, "actor_rollout_ref.rollout.dtype=bfloat16"]
    colocated = steps_in_process(load_config("grpo_tiny", in_bfloat16), 3, colocated=True)
    separate = steps_in_process(
        load_config("grpo_tiny", in_bfloat16 + ["actor_rollout_ref.hybrid_engine=false"]), 3, colocated=False
    )
    for together, apart in zip(colocated, separate):  # bfloat16 (rollout.dtype): the same cast of the same weights
        for name in STEP_METRICS:
            assert together[name] == apart[name], name
    in_float32 = load_config("grpo_tiny", tiny_overrides + ["actor_rollout_ref.rollout.dtype=float32"])
    rows = steps_in_process(in_float32, 3, colocated=True)
    assert all(row["training/rollout_probs_diff_max"] < 1e-4 for row in rows)  # sampled with the trained weights
    assert all(row["training/rollout_probs_diff_max"] < 5e-2 for row in colocated)  # up to bfloat16's rounding


SLEEP_AND_WAKE = ("wake_before", "wake_after", "sleep_before", "sleep_after")
UPDATED_WEIGHTS_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}
"""W=2 sums each gradient in another order than W=1 (per rank, then over ranks), and AdamW's g / (|g| + eps)
turns the last bits of a small gradient into up to ~1% of the learning rate: test_data_parallel's tolerance."""


def test_every_rank_samples_its_share_as_one_rank_would(ray_local, tiny_overrides, tmp_path):
    """verl's hybrid engine at W=2 on gloo: each rank samples its share of the prompts with the full weights it
    gathers from its shards, and sleeps while the ranks train. Per-trajectory seeds make the tokens those of one
    colocated rank, bit for bit, step after step; metrics and trained weights agree within the data-parallel
    tolerance, and so do the rollout's log-probs; each rank reports its memory around sleeping and waking."""
    words = tiny_overrides + ["trainer.total_training_steps=3", "actor_rollout_ref.actor.resources.num_cpus=0.5"]
    one = load_config("grpo_tiny", words)
    two = load_config("grpo_tiny", words + ["trainer.n_cpu_ranks_per_node=2"])
    assert one.colocated and two.colocated and two.data_parallel_size == 2  # verl's default layout at any W

    def run_steps(cfg, orchestrated: bool):
        run = start_run(cfg, orchestrated=orchestrated)
        try:
            assert run.workers.rollout is run.workers.actor
            state = TrainerState(cfg, len(run.train_set))
            steps = list(train_steps(run, state, make_trainer(run, state), range(1, 4)))
            run.workers.actor.save_pretrained(str(tmp_path / f"w{cfg.data_parallel_size}"))
        finally:
            run.workers.shutdown()
        return steps

    alone, shared = run_steps(one, orchestrated=False), run_steps(two, orchestrated=True)
    for single, ranked in zip(alone, shared):
        assert torch.equal(single.batch["responses"], ranked.batch["responses"]), single.step
        torch.testing.assert_close(  # sampled by weights that agree within the data-parallel tolerance
            ranked.batch["rollout_log_probs"], single.batch["rollout_log_probs"], **UPDATED_WEIGHTS_TOLERANCE
        )
        for name in STEP_METRICS:
            assert ranked.metrics[name] == pytest.approx(single.metrics[name], rel=1e-4, abs=1e-6), name
        memory = [ranked.metrics[f"perf/actor/rollout_{phase}_gb"] for phase in SLEEP_AND_WAKE]
        assert all(value > 0 for value in memory)
        assert ranked.batch["weight_version"].eq(ranked.step - 1).all()  # the weights the ranks train now
    one_rank, two_ranks = (
        AutoModelForCausalLM.from_pretrained(tmp_path / f"w{ranks}").state_dict() for ranks in (1, 2)
    )
    for name, tensor in one_rank.items():
        torch.testing.assert_close(two_ranks[name], tensor, **UPDATED_WEIGHTS_TOLERANCE)
