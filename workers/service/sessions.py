"""Token-true trajectories behind the gateway: what one session (one trajectory) fed the model and what it sampled.

A :class:`Session` keeps *heads*: states the agent can continue from, each the conversation the agent has seen
(chat messages, or a completion prompt's text) and the exact tokens behind it (an :class:`AgentLoopOutput`: the
prompt ids, then sampled tokens, mask 1, and the tokens of what the agent added, mask 0). A request whose
conversation extends a head continues it with only the added messages rendered; one that extends none (the agent
edited its history) starts a new segment from the whole conversation rendered anew. Details: docs/gateway.md.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from ppoflow.workers.rollout.requests import TokenOutput
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.service.agent_loop import AgentLoopOutput, AgentSettings, turn_seed
from ppoflow.workers.service.tool_calls import ToolCall, ToolCallParser


class GatewayError(ValueError):
    """A request the gateway refuses: ``status`` (4xx) and a message naming what is wrong."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Choice:
    """One sampled choice of a request: its text and tool calls as the agent sees them, why it ended, and
    the tokens behind it (with their log-probs and weight versions)."""

    text: str
    tool_calls: list
    finish_reason: str
    output: TokenOutput


@dataclass(frozen=True)
class Sampled:
    """What a request asks of sampling, the OpenAI parameters read (None: the run's setting)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1


@dataclass
class Head:
    """A state of the session: ``seen`` (normalised chat messages, or a completion prompt's text) and the
    trajectory whose tokens are exactly what the model was fed and sampled for it."""

    seen: list[dict] | str
    output: AgentLoopOutput

    @property
    def context_ids(self) -> list[int]:
        return self.output.prompt_ids + self.output.response_ids


def message_text(content) -> str:
    """A message's text: a string, OpenAI content parts (their ``text`` joined), or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def canonical_arguments(arguments) -> dict | str:
    """A call's arguments as compared and rendered: parsed JSON when they are JSON text, else as given."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normalize(message: dict) -> dict:
    """What of a chat message decides its tokens: role, text and (for the assistant) the calls made."""
    normal = {"role": message["role"], "content": message_text(message.get("content"))}
    if message["role"] == "assistant":
        normal["tool_calls"] = [
            (call["function"]["name"], canonical_arguments(call["function"].get("arguments", "{}")))
            for call in message.get("tool_calls") or []
        ]
    return normal


def template_message(message: dict) -> dict:
    """A normalised message in the shape chat templates read (calls with their arguments as a dict)."""
    rendered = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        rendered["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in message["tool_calls"]
        ]
    return rendered


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's ``choice``-th sample (``n`` > 1): the first keeps the turn's seed."""
    if choice == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}/choice{choice}".encode()).digest()[:8], "little") % (2**63)


class Session:
    """One trajectory's requests through the gateway. ``prompt`` is the dataset row's prompt (a string or
    chat messages) whose tokens are ``prompt_ids``: a first request that starts with it is fed exactly those."""

    def __init__(
        self,
        session_id: str,
        *,
        prompt_ids: list[int],
        prompt,
        seed: int,
        sampling: SamplingParams,
        settings: AgentSettings,
        tokenizer,
        parser: ToolCallParser,
        template_kwargs: dict | None = None,
    ):
        self.session_id, self.seed, self.sampling, self.settings = session_id, seed, sampling, settings
        self.tokenizer, self.parser, self.template_kwargs = tokenizer, parser, template_kwargs or {}
        start = AgentLoopOutput(list(prompt_ids))
        self.heads: list[Head] = []
        if isinstance(prompt, str):
            self.heads += [Head([{"role": "user", "content": prompt}], start), Head(prompt, start)]
        elif isinstance(prompt, list):
            self.heads.append(Head([normalize(m) for m in prompt], start))
        self.heads.append(Head(None, start))  # token prompts: continued by ids alone
        self.segments = 1
        self.turns = 0

    # -- where a request continues ------------------------------------------------------------------------

    def chat_head(self, messages: list[dict], tools: list[dict] | None) -> Head:
        """The head a chat request samples from: a copy of the head its messages extend, the added
        messages' tokens appended (mask 0), else a new segment."""
        seen = [normalize(m) for m in messages]
        for head in self.heads:
            if not isinstance(head.seen, list) or seen[: len(head.seen)] != head.seen:
                continue
            added = seen[len(head.seen) :]
            if any(m["role"] == "assistant" for m in added):
                continue  # an assistant turn the model did not sample here
            output = copy.deepcopy(head.output)
            if added:
                self._append_context(output, self._context_ids(added), calls=sum(m["role"] == "tool" for m in added))
            return Head(seen, output)
        return self._new_segment(seen, self._prompt_ids(seen, tools))

    def text_head(self, prompt: str | list[int]) -> Head:
        """The head a completion request samples from: a head whose text (or token ids) the prompt extends,
        the rest appended, else a new segment."""
        for head in self.heads:
            if isinstance(prompt, list) and head.seen is None and prompt[: len(head.context_ids)] == head.context_ids:
                added_ids = prompt[len(head.context_ids) :]
            elif isinstance(prompt, str) and isinstance(head.seen, str) and prompt.startswith(head.seen):
                added = prompt[len(head.seen) :]
                added_ids = self.tokenizer(added, add_special_tokens=False)["input_ids"] if added else []
            else:
                continue
            output = copy.deepcopy(head.output)
            if added_ids:
                self._append_context(output, added_ids, calls=0)
            return Head(prompt if isinstance(prompt, str) else None, output)
        ids = prompt if isinstance(prompt, list) else self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return self._new_segment(prompt if isinstance(prompt, str) else None, ids)

    def room(self, head: Head) -> int:
        """Response tokens the head's segment may still take (``data.max_response_length`` in all)."""
        return self.settings.response_length - len(head.output.response_ids)

    def next_turn_seed(self) -> int:
        """The seed of the session's next model turn: as ``tool_agent``'s k-th turn."""
        self.turns += 1
        return turn_seed(self.seed, self.turns)

    def advance(self, heads: list[Head]) -> None:
        """The heads a request's choices made (the first is the trajectory unless the agent continues another)."""
        self.heads = heads + [Head(None, heads[0].output)] if heads else self.heads

    def trajectory(self) -> AgentLoopOutput:
        """The session's trajectory: its newest segment, as far as the agent took it."""
        output = self.heads[0].output
        output.extra_fields["segments"] = self.segments
        return output

    # -- rendering ------------------------------------------------------------------------------------------

    def assistant_message(self, text: str, calls: list[ToolCall]) -> dict:
        """A sampled turn as the agent will send it back (normalised)."""
        return {
            "role": "assistant",
            "content": text,
            "tool_calls": [(call.name, canonical_arguments(call.arguments)) for call in calls],
        }

    def _new_segment(self, seen, prompt_ids: list[int]) -> Head:
        if any(head.output.response_ids for head in self.heads):
            self.segments += 1
        return Head(seen, AgentLoopOutput(list(prompt_ids)))

    def _append_context(self, output: AgentLoopOutput, ids: list[int], *, calls: int) -> None:
        output.add_tool_answer(ids[: max(0, self.settings.response_length - len(output.response_ids))], calls=calls)

    def _has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _prompt_ids(self, seen: list[dict], tools: list[dict] | None) -> list[int]:
        """A whole conversation's tokens: the chat template's rendering, or the plain one without a template."""
        if self._has_template():
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in seen],
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                **self.template_kwargs,
            )
        else:
            text = "".join(self._plain(m) for m in seen)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _context_ids(self, added: list[dict]) -> list[int]:
        """Tokens of messages added after a sampled turn: tool answers as ``tool_agent`` writes them (each cut
        to ``max_tool_response_length``), other messages by the chat template (or plainly)."""
        if all(m["role"] == "tool" for m in added):
            limit = self.settings.max_tool_response_length
            return [i for m in added for i in self.parser.answer_ids(m["content"], self.tokenizer)[:limit]]
        if self._has_template():
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in added], add_generation_prompt=True, tokenize=False, **self.template_kwargs
            )
        else:
            text = "".join(self._plain(m) for m in added)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _plain(self, message: dict) -> str:
        """A message without a chat template: its text; a call or a tool answer in the tool-call format."""
        if message["role"] == "tool":
            return self.parser.answer_text(message["content"])
        calls = "".join(self.parser.call_text(ToolCall(*call)) for call in message.get("tool_calls", []))
        return message["content"] + calls
