"""Bad reward model and reward service settings fail before Ray or any model starts: exit 2, one message naming the
key, no traceback (the reward model's path and head, its tokenizer, the service's host, its key's variable)."""

import pytest

from ppoflow.configs import load_config
from ppoflow.flows.preflight import preflight
from ppoflow.workers.reward_model import build_tiny_reward_model
from tests.conftest import free_port
from tests.preflight_helpers import DEMO, assert_user_error, run_cli
from tests.reward_server_helpers import RewardServer
from tests.test_reward_model import SPEC

pytestmark = pytest.mark.reliability


def test_a_reward_model_path_without_a_model(capsys, tiny_overrides, tmp_path):
    words = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}/nothing"]
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, *words)
    assert_user_error(code, stderr, "reward_model.model.path: ", f"{tmp_path}/nothing")


def test_a_model_without_a_reward_head(capsys, tiny_overrides, tiny_model):
    code, stderr = run_cli(
        capsys,
        *DEMO,
        *tiny_overrides,
        "reward_model.enable=true",
        f"reward_model.model.path={tiny_model}",
    )
    assert_user_error(code, stderr, f"reward_model.model.path: {tiny_model} holds a LlamaForCausalLM, neither")


def test_a_reward_model_needs_its_path(capsys, tiny_overrides):
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, "reward_model.enable=true")
    assert_user_error(code, stderr, "reward_model.model.path: needed when reward_model.enable=true")


def test_a_reward_service_nobody_answers_at(capsys, tiny_overrides):
    url = f"http://127.0.0.1:{free_port()}/score"
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"reward_model.remote.url={url}")
    assert_user_error(code, stderr, f"reward_model.remote.url: no reward service answers at {url}")


def test_a_reward_service_key_that_is_not_set(capsys, monkeypatch, tiny_overrides):
    monkeypatch.delenv("TEST_REWARD_KEY", raising=False)
    with RewardServer() as server:
        words = [f"reward_model.remote.url={server.url}", "reward_model.remote.api_key_env=TEST_REWARD_KEY"]
        code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, *words)
    assert_user_error(code, stderr, "reward_model.remote.api_key_env: $TEST_REWARD_KEY is not set")


def test_a_reachable_service_and_a_reward_model_pass(tiny_overrides, tmp_path):
    path = str(tmp_path / "rm")
    build_tiny_reward_model(path, SPEC)
    with RewardServer() as server:
        preflight(load_config("grpo_tiny", tiny_overrides + [f"reward_model.remote.url={server.url}"]))
    preflight(
        load_config("grpo_tiny", tiny_overrides + ["reward_model.enable=true", f"reward_model.model.path={path}"])
    )


def judge_words(tmp_path, model_path: str) -> list[str]:
    """A judge on a model of its own (``reward_model.judge.model.path``), its parser written under ``tmp_path``."""
    (tmp_path / "parser.py").write_text(
        "def parse(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    return [
        "actor_rollout_ref.rollout.mode=async",
        "reward_model.judge.prompt_template='{response}?'",
        f"reward_model.judge.parser_path={tmp_path}/parser.py",
        f"reward_model.judge.model.path={model_path}",
    ]


def test_a_judge_model_that_does_not_generate(capsys, tiny_overrides, tmp_path):
    path = str(tmp_path / "rm")
    build_tiny_reward_model(path, SPEC)
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, *judge_words(tmp_path, path))
    assert_user_error(code, stderr, f"reward_model.judge.model.path: {path} holds a LlamaForSequenceClassification")


def test_a_judge_model_whose_context_is_too_short(capsys, tiny_overrides, tiny_model, tmp_path):
    words = judge_words(tmp_path, tiny_model) + ["reward_model.judge.max_tokens=60"]
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, *words)
    assert_user_error(
        code,
        stderr,
        "reward_model.judge.model.path: data.max_prompt_length + data.max_response_length + "
        "reward_model.judge.max_tokens = 71 exceeds the model's max_position_embeddings=64",
    )


def test_a_judge_model_path_without_a_judge(capsys, tiny_overrides, tiny_model):
    code, stderr = run_cli(capsys, *DEMO, *tiny_overrides, f"reward_model.judge.model.path={tiny_model}")
    assert_user_error(code, stderr, "reward_model.judge.model.path: a judge model without a judge")


def test_a_judge_model_passes_and_reserves_its_replicas(tiny_overrides, tiny_model, tmp_path):
    from ppoflow.workers.memory_estimate import estimate_memory
    from ppoflow.workers.resources import role_resources

    cfg = load_config(
        "grpo_tiny", tiny_overrides + judge_words(tmp_path, tiny_model) + ["reward_model.judge.num_replicas=2"]
    )
    preflight(cfg)
    assert role_resources(cfg)["reward_model.judge (2 replicas)"].num_cpus == 2
    (judge,) = [estimate for estimate in estimate_memory(cfg)[0] if estimate.role == "judge"]
    assert judge.processes == 2 and judge.describe().startswith("the judge needs")
