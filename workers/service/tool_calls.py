"""Tool-call formats (``actor_rollout_ref.rollout.multi_turn.format``): how a model turn's text calls tools and how
a tool's answer is written for the model. ``tool_agent`` reads one call a turn; the gateway returns every call of a
turn in OpenAI's ``tool_calls`` form and renders the conversation an agent sends back with the same format.
Details: docs/rollout_service.md#tools, docs/gateway.md.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict | str


def tool_schemas(tools) -> list[dict]:
    """The OpenAI function schemas of a tool runner's tools, each named as its spec (none for None)."""
    if tools is None:
        return []
    return [{"function": {**spec.schema["function"], "name": spec.name}} for spec in tools.specs.values()]


class ToolCallParser(ABC):
    """Reads tool calls out of a model turn, and writes calls and answers as the text the model sees."""

    def stop_texts(self) -> tuple[str, ...]:
        """Texts that end a model turn besides EOS (each must be one token of the tokenizer)."""
        return ()

    def parse(self, turn_text: str, tools) -> ToolCall | None:
        """The turn's first call to one of ``tools`` (a tool runner, or None), or None."""
        _, calls = self.split(turn_text, tool_schemas(tools))
        return calls[0] if calls else None

    @abstractmethod
    def split(self, turn_text: str, schemas: list[dict]) -> tuple[str, list[ToolCall]]:
        """The turn's text without its calls, and its calls (``schemas``: the OpenAI function schemas offered)."""

    @abstractmethod
    def call_text(self, call: ToolCall) -> str:
        """A call as the model writes it (to render a conversation that holds one)."""

    @abstractmethod
    def answer_text(self, text: str) -> str:
        """A tool's answer as the model sees it, where no chat template renders it."""

    def answer_ids(self, text: str, tokenizer) -> list[int]:
        """The tokens of a tool's answer appended after a model turn."""
        return tokenizer(self.answer_text(text), add_special_tokens=False)["input_ids"]


class HermesParser(ToolCallParser):
    """verl's default format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the turn; the
    answer is the chat template's rendering of a ``tool`` message (with the generation prompt after it)."""

    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def split(self, turn_text: str, schemas: list[dict]) -> tuple[str, list[ToolCall]]:
        calls = []
        for found in self.CALL.findall(turn_text):
            try:
                call = json.loads(found)
                calls.append(ToolCall(str(call["name"]), call.get("arguments", {})))
            except (ValueError, KeyError, TypeError):
                calls.append(ToolCall("<unparsable>", found))
        return self.CALL.sub("", turn_text).strip(), calls

    def call_text(self, call: ToolCall) -> str:
        return f"<tool_call>{json.dumps({'name': call.name, 'arguments': call.arguments})}</tool_call>"

    def answer_text(self, text: str) -> str:
        return f"<tool_response>{text}</tool_response>"

    def answer_ids(self, text: str, tokenizer) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [{"role": "tool", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]


class QuestionMarkParser(ToolCallParser):
    """A call format small enough for a character-level model: a turn that ends with ``?`` calls the first
    offered tool, with the turn's text before the ``?`` as its only string argument (none if the tool
    takes none); the answer is written ``=<answer>>``."""

    def stop_texts(self) -> tuple[str, ...]:
        return ("?",)

    def split(self, turn_text: str, schemas: list[dict]) -> tuple[str, list[ToolCall]]:
        if not turn_text.endswith("?") or not schemas:
            return turn_text, []
        function = schemas[0]["function"]
        names = list(function.get("parameters", {}).get("properties", {}))
        argument = turn_text[:-1]
        return "", [ToolCall(function["name"], {names[0]: argument} if names else {})]

    def call_text(self, call: ToolCall) -> str:
        arguments = call.arguments if isinstance(call.arguments, dict) else {}
        return f"{next(iter(arguments.values()), '')}?"

    def answer_text(self, text: str) -> str:
        return f"={text}>"


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser(), "question_mark": QuestionMarkParser()}
"""``actor_rollout_ref.rollout.multi_turn.format`` -> parser."""
