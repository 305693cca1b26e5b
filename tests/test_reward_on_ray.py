"""Scoring on Ray through prefect-ray: the same scores as in the flow, as Prefect task runs on Ray workers."""

import pytest

from ppoflow.algorithms.scoring import ScorerFailed, ScorerTimedOut, score_responses
from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.run import start_run
from ppoflow.tasks.reward import score_on_ray
from ppoflow.workers.service.scorer_process import ScorerProcess


def test_scoring_on_ray_equals_scoring_in_the_flow(prefect_api, ray_local):
    solutions = ["12", "1", "123", "", "21", "12", "99"]
    truths = ["12", "12", "12", "12", "12", "12", "99"]
    sources = ["synthetic/copy"] * len(solutions)
    state = score_on_ray(sources, solutions, truths, None, chunks=3, return_state=True)
    assert state.is_completed(), state
    assert state.result() == score_responses(sources, solutions, truths)


SCORERS = """
def length(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": len(solution_str) / 3, "matches": float(solution_str == ground_truth)}

def counted_failure(data_source, solution_str, ground_truth, extra_info=None):
    with open(__file__ + ".calls", "a") as calls:
        calls.write(".")
    raise RuntimeError("the judge is down")

def by_info(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 1:
        raise KeyError("judge_url")
    return float(extra_info["index"])

def counted_hang(data_source, solution_str, ground_truth, extra_info=None):
    import time
    with open(__file__ + ".calls", "a") as calls:
        calls.write(".")
    if solution_str == "hang":
        time.sleep(10**9)
    return 1.0
"""


def test_a_custom_scorer_process_on_ray_scores_as_in_the_flow(prefect_api, ray_local, tmp_path):
    (tmp_path / "scorers.py").write_text(SCORERS)
    solutions, truths = ["12", "1", "123", "", "21"], ["12", "12", "12", "12", "21"]
    sources = ["my/task"] * len(solutions)
    with ScorerProcess(str(tmp_path / "scorers.py"), "length", timeout_s=60) as scorer:  # travels as its settings
        state = score_on_ray(sources, solutions, truths, scorer, chunks=2, return_state=True)
        assert state.is_completed(), state
        assert state.result() == score_responses(sources, solutions, truths, scorer)


def test_extra_info_and_error_score_travel_to_ray_workers(prefect_api, ray_local, tmp_path):
    (tmp_path / "scorers.py").write_text(SCORERS)
    infos = [{"index": index} for index in range(5)]
    sources, solutions, truths = ["my/task"] * 5, ["1"] * 5, ["1"] * 5
    with ScorerProcess(str(tmp_path / "scorers.py"), "by_info", timeout_s=60, error_score=-1.0) as scorer:
        state = score_on_ray(sources, solutions, truths, scorer, chunks=2, extra_infos=infos, return_state=True)
        assert state.is_completed(), state
        assert state.result() == ([0.0, -1.0, 2.0, 3.0, 4.0], {"scorer_errors": [0.0, 1.0, 0.0, 0.0, 0.0]})


def failure_of(state, kind: type[Exception]) -> str:
    """The message of the ``kind`` error a failed flow run's state holds."""
    assert state.is_failed()
    with pytest.raises(kind) as caught:
        state.result()
    return str(caught.value)


@pytest.mark.reliability
def test_a_failing_scorer_on_ray_is_not_retried(prefect_api, ray_local, tmp_path):
    (tmp_path / "scorers.py").write_text(SCORERS)
    scorer = ScorerProcess(str(tmp_path / "scorers.py"), "counted_failure", timeout_s=60)
    state = score_on_ray(["my/task"], ["12"], ["12"], scorer, chunks=1, prompt_ids=["4-0"], return_state=True)
    assert failure_of(state, ScorerFailed) == (
        f"the custom scorer '{tmp_path / 'scorers.py'}:counted_failure' raised RuntimeError: "
        "the judge is down while scoring a response to prompt '4-0' (data source 'my/task')"
    )
    assert (tmp_path / "scorers.py.calls").read_text() == "."  # once: a scorer's failure is not retried


@pytest.mark.reliability
def test_a_hanging_scorer_on_ray_has_its_deadline_and_policy(prefect_api, ray_local, tmp_path):
    """The deadline and on_timeout travel with the scorer to the Ray worker: a timeout fails the chunk once
    (never retried), or scores timeout_score and is counted."""
    (tmp_path / "scorers.py").write_text(SCORERS)
    failing = ScorerProcess(str(tmp_path / "scorers.py"), "counted_hang", timeout_s=1)
    state = score_on_ray(["my/task"], ["hang"], ["12"], failing, chunks=1, prompt_ids=["6-0"], return_state=True)
    assert failure_of(state, ScorerTimedOut) == (
        f"the custom scorer '{tmp_path / 'scorers.py'}:counted_hang' did not return within "
        "custom_reward_function.timeout_s=1 s (its process was killed) while scoring a "
        "response to prompt '6-0' (data source 'my/task')"
    )
    assert (tmp_path / "scorers.py.calls").read_text() == "."
    scoring = ScorerProcess(
        str(tmp_path / "scorers.py"), "counted_hang", timeout_s=1, on_timeout="score", timeout_score=-1.0
    )
    state = score_on_ray(["my/task"] * 2, ["hang", "12"], ["12"] * 2, scoring, chunks=1, return_state=True)
    assert state.result() == ([-1.0, 1.0], {"scorer_timeouts": [1.0, 0.0]})


def test_scoring_on_ray_needs_a_prefect_server(tiny_overrides):
    cfg = load_config("grpo_tiny", tiny_overrides + ["reward_model.reward_manager=ray"])
    with pytest.raises(ValueError, match="reward_model.reward_manager=ray .* set PREFECT_API_URL"):
        start_run(cfg, orchestrated=False)


def test_scoring_on_ray_needs_a_cpu_beyond_the_actors(tiny_overrides, ray_local):
    from ppoflow.workers.launcher import start_workers

    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [
            "reward_model.reward_manager=ray",
            "actor_rollout_ref.hybrid_engine=false",
            "actor_rollout_ref.rollout.resources.num_cpus=2",
            "actor_rollout_ref.actor.resources.num_cpus=2",
        ],
    )
    assert not cfg.use_reference and not cfg.use_critic  # the two roles above take all 4 CPUs of ray_local
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref.actor.resources.num_cpus: the roles need 5 CPU .*has 4 "
        r".*1 for reward_model.reward_manager=ray",
    ):
        start_workers(cfg)
