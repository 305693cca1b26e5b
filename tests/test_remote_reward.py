"""The HTTP reward service client (reward_model.remote) against a real server on 127.0.0.1: each schema, retries
with backoff, the concurrency limit, the key, and a slow, flaky, down or wrong-schema service, which fails the step
naming the URL or scores error_score, per config - in bounded time, never a hang."""

import time

import pytest

from ppoflow.algorithms.scoring import copy_score
from ppoflow.configs import load_config
from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from ppoflow.workers.remote_reward import REMOTE_ERRORS, RemoteReward, RemoteRewardFailed, RewardSample
from tests.config_helpers import only_problem
from tests.conftest import free_port, small_run
from tests.reward_server_helpers import RewardServer

RESPONSES = ["a", "banana", "", "aaa", "xyz", "abracadabra", "a a"]


def samples(responses=RESPONSES) -> list[RewardSample]:
    return [
        RewardSample(f"1-{i}", "chat/open", f"prompt {i}: ", text, ground_truth=f"truth {i}", extra_info={"i": i})
        for i, text in enumerate(responses)
    ]


def client(url: str, **settings) -> RemoteReward:
    overrides = [f"reward_model.remote.url={url}", "reward_model.remote.backoff_s=0.01"]
    overrides += [f"reward_model.remote.{key}={value}" for key, value in settings.items()]
    return RemoteReward(load_config("grpo_tiny", overrides).reward_model.remote)


@pytest.mark.parametrize("schema", ["ppoflow", "openrlhf", "verl"])
def test_each_schema_scores_every_response_in_order(schema):
    with RewardServer(schema) as server:
        scores, extras = client(server.url, format=schema, batch_size=3).score(samples())
    assert scores == [float(text.count("a")) for text in RESPONSES]
    assert extras[REMOTE_ERRORS] == [0.0] * len(RESPONSES)
    assert len(server.requests) == 3  # 7 responses, 3 to a request
    body = next(body for _, body in server.requests if "truth 0" in str(body))  # requests arrive in any order
    if schema == "ppoflow":
        assert body["samples"][1] == {
            "uid": "1-1",
            "data_source": "chat/open",
            "prompt": "prompt 1: ",
            "response": "banana",
            "ground_truth": "truth 1",
            "extra_info": {"i": 1},
        }
    elif schema == "openrlhf":
        assert body["query"][1] == "prompt 1: banana" and body["labels"][1] == "truth 1"
    else:
        assert body[1]["solution_str"] == "banana" and body[1]["extra_info"] == {"i": 1}
        assert extras["length"] == [3.0] * len(RESPONSES)  # verl's dict scores keep their extras


def test_a_flaky_service_is_retried_and_scores():
    with RewardServer(fail_first=2) as server:
        scores, _ = client(server.url, max_retries=2, batch_size=64).score(samples())
    assert scores[1] == 3.0 and len(server.requests) == 3


def test_requests_in_flight_never_exceed_the_concurrency_limit():
    with RewardServer(delay_s=0.2) as server:
        client(server.url, batch_size=1, max_concurrency=2).score(samples())
    assert len(server.requests) == len(RESPONSES) and server.most_in_flight == 2


def test_the_key_comes_from_the_named_environment_variable(monkeypatch):
    monkeypatch.setenv("TEST_REWARD_KEY", "s3cret")
    with RewardServer(api_key="s3cret") as server:
        scores, _ = client(server.url, api_key_env="TEST_REWARD_KEY").score(samples())
        assert scores[0] == 1.0 and server.requests[0][0]["Authorization"] == "Bearer s3cret"
        with pytest.raises(RemoteRewardFailed, match="answered HTTP 401.* after 1 attempt "):  # never retried
            client(server.url, max_retries=3).score(samples())
    monkeypatch.delenv("TEST_REWARD_KEY")
    with pytest.raises(ValueError, match=r"reward_model.remote.api_key_env: \$TEST_REWARD_KEY is not set"):
        client(server.url, api_key_env="TEST_REWARD_KEY")


def failure_after_retries(url: str, pattern: str, **settings) -> float:
    """Fails with ``pattern``, naming the URL and the key, after 1 + 2 attempts; how long that took."""
    started = time.monotonic()
    with pytest.raises(RemoteRewardFailed) as caught:
        client(url, max_retries=2, **settings).score(samples())
    assert url in str(caught.value) and "(reward_model.remote.url)" in str(caught.value)
    assert "after 3 attempts" in str(caught.value)
    assert pattern in str(caught.value), caught.value
    return time.monotonic() - started


def test_a_slow_service_fails_in_bounded_time():
    with RewardServer(delay_s=5) as server:
        seconds = failure_after_retries(server.url, "took over timeout_s=0.3", timeout_s=0.3)
    assert seconds < 4  # 3 attempts of 0.3 s and short backoffs, not the service's 5 s each


def test_a_service_that_is_down_fails_clearly():
    failure_after_retries(f"http://127.0.0.1:{free_port()}/score", "could not be reached")


def test_a_wrong_schema_fails_saying_what_it_answered():
    with RewardServer() as server:
        server.wrong_answer = {"rewards": [1.0]}
        failure_after_retries(server.url, "answered without 'scores' (keys 'rewards')")
        server.wrong_answer = {"scores": [1.0, 2.0]}
        failure_after_retries(server.url, "answered 2 scores for 7 responses")
        server.wrong_answer = {"scores": ["good"] * 7}
        failure_after_retries(server.url, "answered 'good' as the score of response 0")


def test_on_error_score_gives_the_failed_requests_responses_error_score():
    with RewardServer(fail_first=1) as server:  # the first request of 3 fails (one at a time: the first 3 samples)
        scores, extras = client(
            server.url, max_retries=0, batch_size=3, max_concurrency=1, on_error="score", error_score=-1.0
        ).score(samples())
    assert scores == [-1.0, -1.0, -1.0, 3.0, 0.0, 5.0, 2.0]
    assert extras[REMOTE_ERRORS] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x", "http:///score", "127.0.0.1:8000"])
def test_only_http_urls_are_accepted(url):
    key, message = only_problem([f"reward_model.remote.url={url}"])
    assert key == "reward_model.remote.url" and "must be an http:// or https:// URL with a host" in message


def test_a_training_step_adds_the_service_score_to_the_rule_score(prefect_api, ray_local, tiny_overrides, tmp_path):
    with RewardServer(score_of=len) as server:
        words = [f"reward_model.remote.url={server.url}", "trainer.total_training_steps=1", "trainer.test_freq=-1"]
        state = ppo_train(config="grpo_tiny", overrides=tiny_overrides + words, return_state=True)
    assert state.is_completed(), state
    sent = [sample for _, body in server.requests for sample in body["samples"]]
    assert len(sent) == 16  # 4 prompts x 4 responses, one stage call
    rule = [copy_score("synthetic/copy", s["response"], s["ground_truth"])["score"] for s in sent]
    model = [len(s["response"]) for s in sent]
    (metrics,) = read_metrics(str(tmp_path / "run"))
    assert metrics["reward_model/score/mean"] == pytest.approx(sum(model) / 16)
    assert metrics["critic/score/mean"] == pytest.approx((sum(rule) + sum(model)) / 16)  # reward_model.combine=sum


@pytest.mark.slow  # a run (~7 s); the client's failures are unit-tested above
def test_a_service_that_fails_every_request_fails_the_step_naming_the_url(prefect_api, ray_local, tiny_overrides):
    """It answers preflight's connection (a service that is down there is exit 2: test_reward_preflight.py), then
    503 to every request: the step fails after the bounded retries, naming the URL."""
    words = ["reward_model.remote.backoff_s=0.01", "trainer.test_freq=-1"]
    with RewardServer(fail_first=10**6) as server:
        words.append(f"reward_model.remote.url={server.url}")
        state = ppo_train(config="grpo_tiny", overrides=tiny_overrides + words, return_state=True)
    assert state.is_failed()
    with pytest.raises(RemoteRewardFailed, match=f"reward service {server.url} answered HTTP 503 .* after 4 attempts"):
        state.result()


@pytest.mark.slow  # two runs (~11 s); the stage cache is tested for every stage in test_cache_flow
def test_the_reward_model_stage_is_cached_like_the_others(prefect_api, ray_local, tiny_model, tmp_path):
    """A second run with the same cached rollout replays the service's scores without asking it again."""
    dump = tmp_path / "dump"
    skip = [f"skip.{stage}.{key}" for stage in ("rollout", "reward_model") for key in ("enable=true", "steps=[1]")]
    skip += [f"skip.{stage}.dump_dir={dump}" for stage in ("rollout", "reward_model")]
    metrics = []
    with RewardServer(score_of=len) as server:
        for attempt in range(2):
            words = small_run(tiny_model, tmp_path / str(attempt)) + skip + ["trainer.test_freq=-1"]
            words += [f"reward_model.remote.url={server.url}", "trainer.total_training_steps=1"]
            state = ppo_train(config="grpo_tiny", overrides=words, return_state=True)
            assert state.is_completed(), state
            metrics.append(read_metrics(str(tmp_path / str(attempt) / "run"))[0])
            assert len(server.requests) == 1  # the second run replayed the stage
    assert metrics[1]["reward_model/score/mean"] == metrics[0]["reward_model/score/mean"]
    assert metrics[1]["skip/reward_model/hit"] == 1.0
