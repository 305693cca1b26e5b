"""Scoring on Ray through prefect-ray: the same scores as in the flow, as Prefect task runs on Ray workers."""

import pytest

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.run import start_run
from ppoflow.algorithms.scoring import score_responses
from ppoflow.tasks.reward import score_on_ray


def test_scoring_on_ray_equals_scoring_in_the_flow(prefect_api, ray_local):
    solutions = ["12", "1", "123", "", "21", "12", "99"]
    truths = ["12", "12", "12", "12", "12", "12", "99"]
    sources = ["synthetic/copy"] * len(solutions)
    state = score_on_ray(sources, solutions, truths, None, chunks=3, return_state=True)
    assert state.is_completed(), state
    assert state.result() == score_responses(sources, solutions, truths)


def test_scoring_on_ray_needs_a_prefect_server(tiny_overrides):
    cfg = load_config("grpo_tiny", tiny_overrides + ["reward_model.reward_manager=ray"])
    with pytest.raises(ValueError, match="reward_model.reward_manager=ray .* set PREFECT_API_URL"):
        start_run(cfg, orchestrated=False)


def test_scoring_on_ray_needs_a_cpu_beyond_the_actors(tiny_overrides, ray_local):
    from ppoflow.workers.group import start_workers

    cfg = load_config("grpo_tiny", tiny_overrides + ["reward_model.reward_manager=ray", "actor_rollout_ref.hybrid_engine=false",
                                                     "actor_rollout_ref.rollout.resources.num_cpus=2",
                                                     "actor_rollout_ref.actor.resources.num_cpus=2"])
    assert not cfg.use_reference and not cfg.use_critic  # the two roles above take all 4 CPUs of ray_local
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.resources.num_cpus: the roles need 5 CPU .*has 4 "
                                          r".*1 for reward_model.reward_manager=ray"):
        start_workers(cfg)
