"""Bad reward model and reward service settings fail before Ray or any model starts: exit 2, one message naming the
key, no traceback (the reward model's path and head, its tokenizer, the service's host, its key's variable)."""

import pytest

from ppoflow.configs import load_config
from ppoflow.flows.preflight import preflight
from ppoflow.workers.reward_model import build_tiny_reward_model
from tests.conftest import free_port
from tests.preflight_helpers import assert_user_error, run_cli
from tests.reward_server_helpers import RewardServer
from tests.test_reward_model import SPEC

pytestmark = pytest.mark.reliability


def test_a_reward_model_path_without_a_model(capsys, tiny_overrides, tmp_path):
    words = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}/nothing"]
    code, stderr = run_cli(capsys, "train", *tiny_overrides, *words)
    assert_user_error(code, stderr, "reward_model.model.path: ", f"{tmp_path}/nothing")


def test_a_model_without_a_reward_head(capsys, tiny_overrides, tiny_model):
    code, stderr = run_cli(
        capsys, "train", *tiny_overrides, "reward_model.enable=true", f"reward_model.model.path={tiny_model}"
    )
    assert_user_error(code, stderr, f"reward_model.model.path: {tiny_model} holds a LlamaForCausalLM, neither")


def test_a_reward_model_needs_its_path(capsys, tiny_overrides):
    code, stderr = run_cli(capsys, "train", *tiny_overrides, "reward_model.enable=true")
    assert_user_error(code, stderr, "reward_model.model.path: needed when reward_model.enable=true")


def test_a_reward_service_nobody_answers_at(capsys, tiny_overrides):
    url = f"http://127.0.0.1:{free_port()}/score"
    code, stderr = run_cli(capsys, "train", *tiny_overrides, f"reward_model.remote.url={url}")
    assert_user_error(code, stderr, f"reward_model.remote.url: no reward service answers at {url}")


def test_a_reward_service_key_that_is_not_set(capsys, monkeypatch, tiny_overrides):
    monkeypatch.delenv("TEST_REWARD_KEY", raising=False)
    with RewardServer() as server:
        words = [f"reward_model.remote.url={server.url}", "reward_model.remote.api_key_env=TEST_REWARD_KEY"]
        code, stderr = run_cli(capsys, "train", *tiny_overrides, *words)
    assert_user_error(code, stderr, "reward_model.remote.api_key_env: $TEST_REWARD_KEY is not set")


def test_a_reachable_service_and_a_reward_model_pass(tiny_overrides, tmp_path):
    path = str(tmp_path / "rm")
    build_tiny_reward_model(path, SPEC)
    with RewardServer() as server:
        preflight(load_config("grpo_tiny", tiny_overrides + [f"reward_model.remote.url={server.url}"]))
    preflight(
        load_config("grpo_tiny", tiny_overrides + ["reward_model.enable=true", f"reward_model.model.path={path}"])
    )
