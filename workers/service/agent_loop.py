"""Agent loops: how one trajectory is produced from one prompt, turn by turn (verl's AgentLoop).

A loop is an object with ``async run(sampling, **row) -> AgentLoopOutput``: it asks the rollout service for tokens
(:class:`LLMClient`, one session's turns on one replica) and for tools (:class:`~.tools.ToolRunner`), and returns
token ids with a response mask (1 on sampled tokens, 0 on tool answers). Loops are registered with :func:`register`
(built in: ``single_turn_agent``, ``tool_agent``) or declared in YAML; many run on one asyncio event loop.
:func:`outputs_to_batch` pads the outputs into the rollout part of the step batch, with ``turn_ids``,
``num_turns`` and ``tool_calls``. Details: docs/rollout_service.md#agent-loops.
"""

from __future__ import annotations

import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from ppoflow.configs import ConfigError
from ppoflow.workers.rollout.requests import RequestSampling, TokenOutput
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.service.tool_calls import TOOL_CALL_PARSERS

AGENT_LOOPS: dict[str, type[AgentLoop]] = {}
"""Registered agent loops by name."""


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make an :class:`AgentLoop` subclass available as ``name`` (a row's ``agent_name``,
    or ``actor_rollout_ref.rollout.agent.default_agent_loop``)."""

    def add(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
            raise TypeError(f"{cls!r} is not an AgentLoop subclass")
        if AGENT_LOOPS.get(name, cls) is not cls:
            raise ValueError(f"agent loop {name!r} is already registered as {AGENT_LOOPS[name].__qualname__}")
        AGENT_LOOPS[name] = cls
        return cls

    return add


def load_agent_loop_config(path: str, key: str = "actor_rollout_ref.rollout.agent.agent_loop_config_path") -> list[str]:
    """Register the loops a YAML file declares (a list of ``{name: ..., _target_: module.Class}``) and
    return their names; any problem is a :class:`ConfigError` naming ``key`` and the entry."""
    import yaml

    from ppoflow.storage.fs import open_fs

    fs, local = open_fs(path)
    if not fs.exists(local):
        raise ConfigError([(key, f"no such file {path!r}")])
    try:
        entries = yaml.safe_load(fs.cat_file(local))
    except yaml.YAMLError as error:
        raise ConfigError([(key, f"{path!r} is not YAML: {error}")]) from None
    if not isinstance(entries, list):
        raise ConfigError([(key, f"{path!r} must hold a list of {{name, _target_}} entries")])
    names = []
    for index, entry in enumerate(entries):
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or not isinstance(entry.get("_target_"), str)
        ):
            raise ConfigError([(key, f"{path!r} entry {index} needs a name and a _target_, got {entry!r:.80}")])
        module_name, _, class_name = entry["_target_"].rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            register(entry["name"])(cls)
        except Exception as error:  # noqa: BLE001 - the user's module may raise anything while it is imported
            raise ConfigError(
                [
                    (
                        key,
                        f"{path!r} entry {index} ({entry['name']}): cannot load "
                        f"{entry['_target_']!r}: {type(error).__name__}: {error}",
                    )
                ]
            ) from None
        names.append(entry["name"])
    return names


@dataclass
class AgentLoopOutput:
    """One trajectory: the prompt, the response tokens after it (the model's and the tools'), and per
    response token whether it is trained on, its sampling log-prob (0 on tool tokens) and its turn (k on the
    model's k-th turn, -k on the k-th block of tokens it did not sample)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_log_probs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    num_turns: int = 0
    """Turns taken: the model's turns plus the tools' answers."""
    tool_calls: int = 0
    weight_versions: tuple[int, int] | None = None
    """The oldest and newest weight version any of the model's tokens was sampled with."""
    extra_fields: dict[str, Any] = field(default_factory=dict)

    def add_model_turn(self, output: TokenOutput) -> None:
        turn = sum(1 for t in set(self.turn_ids) if t > 0) + 1
        self.response_ids += output.token_ids
        self.response_mask += [1] * len(output.token_ids)
        self.response_log_probs += output.log_probs
        self.turn_ids += [turn] * len(output.token_ids)
        self.num_turns += 1
        low, high = output.weight_versions
        self.weight_versions = (
            (low, high)
            if self.weight_versions is None
            else (min(self.weight_versions[0], low), max(self.weight_versions[1], high))
        )

    def add_tool_answer(self, token_ids: list[int], calls: int = 1) -> None:
        """Append tokens the model did not sample (mask 0): ``calls`` tools' answers (0: other context)."""
        block = sum(1 for t in set(self.turn_ids) if t < 0) + 1
        self.tool_calls += calls
        self.response_ids += token_ids
        self.response_mask += [0] * len(token_ids)
        self.response_log_probs += [0.0] * len(token_ids)
        self.turn_ids += [-block] * len(token_ids)
        self.num_turns += 1


class LLMClient(Protocol):
    """What a loop generates with: the rollout service's load balancer."""

    async def generate(self, session_id: str, prompt_ids: list[int], sampling: RequestSampling) -> TokenOutput: ...


@dataclass(frozen=True)
class AgentSettings:
    """What every loop of a run shares (from ``actor_rollout_ref.rollout``)."""

    response_length: int
    """Budget of response tokens per trajectory, the model's and the tools' (``data.max_response_length``)."""
    max_assistant_turns: int
    max_tokens_per_turn: int | None
    """Tokens one model turn may generate at most (None: the rest of the response budget)."""
    max_tool_response_length: int
    tool_format: str
    """How tool calls are written: ``hermes`` or ``question_mark`` (see :data:`TOOL_CALL_PARSERS`)."""
    agent_function: Any = None
    """The ``openai_agent`` loop's user function (an :class:`~.openai_agent.AgentFunction`), if any."""


class AgentLoop(ABC):
    """Produce one trajectory per call of :meth:`run`; one instance serves many concurrent calls."""

    def __init__(self, *, client: LLMClient, tokenizer, settings: AgentSettings, tools=None, gateway=None):
        self.client, self.tokenizer, self.settings, self.tools = client, tokenizer, settings, tools
        self.gateway = gateway
        """The worker's OpenAI-compatible gateway (:mod:`~ppoflow.workers.service.gateway`), when enabled."""

    @abstractmethod
    async def run(self, sampling: SamplingParams, **row) -> AgentLoopOutput:
        """``row``: ``prompt_ids`` (list[int]), ``session_id`` (unique per trajectory), ``seed`` (this
        trajectory's sampling seed), ``tools_kwargs`` (per tool, arguments the dataset fixes for this row),
        ``raw_prompt`` (the dataset's prompt: text or chat messages), ``data_source``, ``extra_info``."""

    def request(
        self, sampling: SamplingParams, *, seed: int, budget: int, stop_token_ids: tuple[int, ...] = ()
    ) -> RequestSampling:
        return turn_request(sampling, self.settings, seed=seed, budget=budget, stop_token_ids=stop_token_ids)


def turn_request(
    sampling: SamplingParams, settings: AgentSettings, *, seed: int, budget: int, stop_token_ids: tuple[int, ...] = ()
) -> RequestSampling:
    """One model turn's request: the run's sampling settings, at most ``budget`` tokens (the rest of the
    trajectory's response budget) and ``max_tokens_per_turn``."""
    return RequestSampling(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        greedy=sampling.greedy,
        max_new_tokens=min(budget, settings.max_tokens_per_turn or budget),
        seed=seed,
        stop_token_ids=stop_token_ids,
    )


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a trajectory's ``turn``: independent per turn, reproducible from ``seed``."""
    return (
        seed
        if turn == 1
        else int.from_bytes(hashlib.sha256(f"{seed}/turn{turn}".encode()).digest()[:8], "little") % (2**63)
    )


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """One generation of up to the whole response budget: the static rollout's trajectory, served by a replica."""

    async def run(self, sampling: SamplingParams, **row) -> AgentLoopOutput:
        output = AgentLoopOutput(list(row["prompt_ids"]))
        request = self.request(sampling, seed=row["seed"], budget=self.settings.response_length)
        output.add_model_turn(await self.client.generate(row["session_id"], output.prompt_ids, request))
        return output


@register("tool_agent")
class ToolAgentLoop(AgentLoop):
    """Generate; if the turn calls a tool, run it and append its answer (masked out of the loss); go on
    until the model stops without a call, ``max_assistant_turns`` model turns, or the response budget.

    A tool that fails, times out or returns garbage gives an error answer (the tool runner's), which the
    model sees like any other answer: a bad tool never ends the run or hangs the step."""

    async def run(self, sampling: SamplingParams, **row) -> AgentLoopOutput:
        settings = self.settings
        parser = TOOL_CALL_PARSERS[settings.tool_format]
        stop_ids = tuple(self.tokenizer.convert_tokens_to_ids(text) for text in parser.stop_texts())
        tools_kwargs = row.get("tools_kwargs") or {}
        output = AgentLoopOutput(list(row["prompt_ids"]))
        errors: list[str] = []
        for turn in range(1, settings.max_assistant_turns + 1):
            budget = settings.response_length - len(output.response_ids)
            if budget <= 0:
                break
            request = self.request(sampling, seed=turn_seed(row["seed"], turn), budget=budget, stop_token_ids=stop_ids)
            generated = await self.client.generate(row["session_id"], output.prompt_ids + output.response_ids, request)
            output.add_model_turn(generated)
            if generated.finish_reason != "stop" or generated.token_ids[-1:] == [self.tokenizer.eos_token_id]:
                break
            call = parser.parse(self.tokenizer.decode(generated.token_ids, skip_special_tokens=False), self.tools)
            if call is None or self.tools is None:
                break
            result = await self.tools.call(call.name, call.arguments, fixed=tools_kwargs.get(call.name))
            if not result.ok:
                errors.append(f"{call.name}: {result.text}")
            answer = parser.answer_ids(result.text, self.tokenizer)[: settings.max_tool_response_length]
            room = settings.response_length - len(output.response_ids)
            output.add_tool_answer(answer[:room])
        if errors:
            output.extra_fields["tool_errors"] = errors
        return output


def make_loops(names: set[str], **shared) -> dict[str, AgentLoop]:
    """One instance of each named loop; an unknown name is a ``ValueError`` listing the registered ones."""
    unknown = sorted(names - set(AGENT_LOOPS))
    if unknown:
        raise ValueError(f"unknown agent loop(s) {', '.join(unknown)}; registered: {', '.join(sorted(AGENT_LOOPS))}")
    return {name: AGENT_LOOPS[name](**shared) for name in names}


def outputs_to_batch(
    outputs: list[AgentLoopOutput], *, prompt_width: int, response_width: int, pad_token_id: int, weight_version: int
) -> TensorDict:
    """The rollout part of the step batch from loop outputs (prompts left-padded to ``prompt_width``,
    responses right-padded to ``response_width``); ``weight_version`` and ``max_weight_version`` are the
    oldest and newest weights a trajectory's tokens were sampled with (they differ when a partial rollout
    resumed it with new weights; a trajectory without model tokens gets ``weight_version``, the version
    served when it started)."""
    rows = len(outputs)
    prompt_width = max([prompt_width] + [len(o.prompt_ids) for o in outputs])
    prompts = torch.full((rows, prompt_width), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.bool)
    responses = torch.full((rows, response_width), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros((rows, response_width), dtype=torch.bool)
    log_probs = torch.zeros((rows, response_width), dtype=torch.float32)
    turn_ids = torch.zeros((rows, response_width), dtype=torch.int64)
    for row, output in enumerate(outputs):
        if len(output.response_ids) > response_width:
            raise ValueError(f"trajectory {row} has {len(output.response_ids)} response tokens > {response_width}")
        length, width = len(output.prompt_ids), len(output.response_ids)
        prompts[row, prompt_width - length :] = torch.tensor(output.prompt_ids, dtype=torch.int64)
        prompt_mask[row, prompt_width - length :] = True
        responses[row, :width] = torch.tensor(output.response_ids, dtype=torch.int64)
        response_mask[row, :width] = torch.tensor(output.response_mask, dtype=torch.bool)
        log_probs[row, :width] = torch.tensor(output.response_log_probs, dtype=torch.float32)
        turn_ids[row, :width] = torch.tensor(output.turn_ids, dtype=torch.int64)
    versions = [o.weight_versions or (weight_version, weight_version) for o in outputs]
    return TensorDict(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
            "turn_ids": turn_ids,
            "weight_version": torch.tensor([low for low, _ in versions], dtype=torch.int64),
            "max_weight_version": torch.tensor([high for _, high in versions], dtype=torch.int64),
            "num_turns": torch.tensor([o.num_turns for o in outputs], dtype=torch.int64),
            "tool_calls": torch.tensor([o.tool_calls for o in outputs], dtype=torch.int64),
        },
        batch_size=[rows],
    )
