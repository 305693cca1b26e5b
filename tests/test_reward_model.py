"""The reward model worker (reward_model.enable): a tiny reward model built from a config - a sequence classifier
or a causal LM with a value head - loaded through the real loading code, scoring chat-formatted prompt + response
re-tokenised with its own tokenizer, in micro-batches or token-budget passes; its head checked from its files;
a training run with it in a Ray actor of its own, the stage reward_model[step=N] in Prefect, cached by weights."""

import json

import pytest
import torch

from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.schema import TinyModelConfig
from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from ppoflow.workers.remote_reward import RewardSample
from ppoflow.workers.reward_model import (
    SEQUENCE_CLASSIFICATION,
    VALUE_HEAD,
    RewardModelWorker,
    build_tiny_reward_model,
    chat_text,
    reward_head,
)
from tests.flow_runs import task_runs_by_name

SPEC = TinyModelConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64
)
SAMPLES = [RewardSample(f"1-{i}", "chat/open", "12+3=", text) for i, text in enumerate(["15", "a", "", "abcabc", "9"])]


@pytest.fixture(scope="module", params=[SEQUENCE_CLASSIFICATION, VALUE_HEAD])
def reward_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rm") / "tiny_rm")
    model, tokenizer = build_tiny_reward_model(path, SPEC, head=request.param)
    return path, request.param, model.eval(), tokenizer


def worker(path: str, *overrides: str) -> RewardModelWorker:
    words = ["reward_model.enable=true", f"reward_model.model.path={path}", *overrides]
    return RewardModelWorker(load_config("grpo_tiny", words))


def test_the_worker_scores_each_response_as_the_model_does_alone(reward_model):
    path, head, model, tokenizer = reward_model
    expected = []
    with torch.no_grad():
        for sample in SAMPLES:
            ids = tokenizer(chat_text(tokenizer, sample), add_special_tokens=False, return_tensors="pt")["input_ids"]
            mask = torch.ones_like(ids)
            out = model(ids, mask)[:, -1] if head == VALUE_HEAD else model(input_ids=ids).logits[:, 0]
            expected.append(float(out))
    loaded = worker(path)
    assert loaded.head == head
    for scored in (
        loaded,
        worker(path, "reward_model.micro_batch_size_per_gpu=2"),
        worker(path, "reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=12"),
    ):
        scores, extras = scored.score(SAMPLES)
        assert scores == pytest.approx(expected, abs=1e-5) and extras == {}
    assert len(set(expected)) == len(expected)  # the responses score differently: the test could fail


def test_the_reward_models_chat_template_formats_prompt_and_response(reward_model):
    path, _, _, tokenizer = reward_model
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"
    assert chat_text(tokenizer, SAMPLES[0]) == "u:12+3=|a:15|"
    tokenizer.chat_template = None
    assert chat_text(tokenizer, SAMPLES[0]) == "12+3=15"


def test_max_length_keeps_the_end_of_the_response(reward_model):
    path = reward_model[0]
    pair = [RewardSample("1-0", "x", "0000000000", "abcdef"), RewardSample("1-1", "x", "1", "abcdef")]
    whole, _ = worker(path).score(pair)
    cut, _ = worker(path, "reward_model.max_length=6").score(pair)
    assert whole[0] != pytest.approx(whole[1], abs=1e-5)
    assert cut[0] == pytest.approx(cut[1], abs=1e-5)  # both read the response alone: its last 6 tokens


def test_a_model_without_a_reward_head_is_refused_naming_the_key(tiny_model, reward_model, tmp_path):
    config = load_config("grpo_tiny", ["reward_model.enable=true", f"reward_model.model.path={tiny_model}"])
    with pytest.raises(ConfigError, match="neither a sequence-classification model with one label nor a causal LM"):
        reward_head(config.reward_model.model)
    path = tmp_path / "two_labels"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"], "num_labels": 2})
    )
    config = load_config("grpo_tiny", ["reward_model.enable=true", f"reward_model.model.path={path}"])
    with pytest.raises(ConfigError) as caught:
        reward_head(config.reward_model.model)
    assert caught.value.problems == [("reward_model.model.path", f"{path} scores 2 labels; a reward model scores one")]


# two runs (~15 s); by default the worker's scores are checked above, the reward-model stage in test_remote_reward
@pytest.mark.slow
def test_a_training_run_scores_with_the_reward_model_worker(prefect_api, ray_local, tiny_overrides, tmp_path):
    """Twice, from the same cached rollout: the second run replays the stage (same batch, same weights)."""
    path = str(tmp_path / "rm")
    build_tiny_reward_model(path, SPEC)
    dump = tmp_path / "dump"
    skip = [f"skip.{stage}.{key}" for stage in ("rollout", "reward_model") for key in ("enable=true", "steps=[1]")]
    skip += [f"skip.{stage}.dump_dir={dump}" for stage in ("rollout", "reward_model")]
    words = ["reward_model.enable=true", f"reward_model.model.path={path}", "reward_model.combine=rule_first"]
    words += ["trainer.total_training_steps=1", "trainer.test_freq=-1", *skip]
    means = []
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        overrides = tiny_overrides + words + [f"trainer.default_local_dir={run}"]
        state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
        assert state.is_completed(), state
        (metrics,) = read_metrics(str(run))
        means.append(metrics["reward_model/score/mean"])
        assert "perf/reward_model/max_rss_gb" in metrics  # its own Ray actor reports its memory
    assert metrics["skip/reward_model/hit"] == 1.0 and means[0] == means[1]
    runs = task_runs_by_name(state.state_details.flow_run_id, ["reward_model[step=1]", "reward[step=1]"])
    assert runs["reward_model[step=1]"].state.is_completed()
