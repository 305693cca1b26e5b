"""The preflight's checks of the model-based rewards (docs/reward_models.md), before Ray or any model starts: the
reward model's paths, its tokenizer and its head (read from its files, not loaded), the judge model's (a causal LM
whose context fits), and the reward service's host accepting connections within :data:`REWARD_SERVICE_TIMEOUT_S`,
with its key's variable set."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

from ppoflow.configs import ConfigError
from ppoflow.configs.schema import PPOConfig
from ppoflow.configs.schema_algorithm import RemoteRewardConfig, RewardModelPathConfig
from ppoflow.workers.models import check_context_length, check_model_paths, load_tokenizer, model_config
from ppoflow.workers.reward_model import PATH_KEY, reward_head

JUDGE_PATH_KEY = "reward_model.judge.model.path"

REWARD_SERVICE_TIMEOUT_S = 5.0
"""How long a TCP connection to the reward service's host may take before it counts as unreachable."""

Problems = list[tuple[str, str]]


def model_reward_problems(cfg: PPOConfig) -> Problems:
    """Every problem of ``reward_model.model`` (when ``enable``) and ``reward_model.remote`` (when ``url``)."""
    rewards = cfg.reward_model
    problems: Problems = []
    if rewards.enable and rewards.model.path:
        problems += _reward_model_problems(rewards.model)
    if rewards.remote.url:
        problems += _reward_service_problems(rewards.remote)
    if cfg.judge_model is not None:
        problems += _judge_model_problems(cfg)
    return problems


def _judge_model_problems(cfg: PPOConfig) -> Problems:
    """The judge model is a causal LM whose context holds a prompt, a response and the verdict, and its tokenizer
    loads."""
    model, key = cfg.judge_model, JUDGE_PATH_KEY
    needed = cfg.data.max_prompt_length + cfg.data.max_response_length + cfg.reward_model.judge.max_tokens
    try:
        check_context_length(
            model, needed, key, what="data.max_prompt_length + data.max_response_length + reward_model.judge.max_tokens"
        )
        architectures = model_config(model, key).get("architectures") or []
    except ConfigError as error:
        return error.problems
    if not any(name.endswith("ForCausalLM") for name in architectures):
        return [
            (
                key,
                f"{model.path} holds a {', '.join(architectures) or 'model of no architecture'}, not a causal "
                "LM: the judge generates its verdict",
            )
        ]
    try:
        load_tokenizer(model)
    except Exception as error:  # noqa: BLE001 - as for the reward model's tokenizer
        key = "reward_model.judge.model.tokenizer_path" if model.tokenizer_path else key
        return [(key, f"no usable tokenizer at {model.tokenizer_path or model.path}: {type(error).__name__}: {error}")]
    return []


def _reward_model_problems(model: RewardModelPathConfig) -> Problems:
    try:
        check_model_paths(model, PATH_KEY)
        reward_head(model)
    except ConfigError as error:
        return error.problems
    try:
        load_tokenizer(model)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for a directory without a tokenizer
        key = "reward_model.model.tokenizer_path" if model.tokenizer_path else PATH_KEY
        return [(key, f"no usable tokenizer at {model.tokenizer_path or model.path}: {type(error).__name__}: {error}")]
    return []


def _reward_service_problems(remote: RemoteRewardConfig) -> Problems:
    problems: Problems = []
    if remote.api_key_env and not os.environ.get(remote.api_key_env):
        problems.append(
            ("reward_model.remote.api_key_env", f"${remote.api_key_env} is not set: the reward service's key")
        )
    parts = urlsplit(remote.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=REWARD_SERVICE_TIMEOUT_S).close()
    except OSError as error:
        problems.append(
            (
                "reward_model.remote.url",
                f"no reward service answers at {remote.url} ({type(error).__name__}: {error}); start it or "
                "correct the URL",
            )
        )
    return problems
