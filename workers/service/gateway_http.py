"""The gateway's HTTP surface (FastAPI): OpenAI's request and response shapes for ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models``, bearer-token auth, streaming as server-sent events, and errors as OpenAI
error objects with a 4xx status (a malformed request is refused, the run goes on). The sampling and the
trajectories are :class:`~ppoflow.workers.service.gateway.Gateway`'s. Details: docs/gateway.md.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ppoflow.workers.service.sessions import Choice, GatewayError, Sampled


class _Body(BaseModel):
    """What the chat and completion requests share: OpenAI's sampling parameters (``top_k`` as vLLM's
    extension); other OpenAI fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False

    def sampled(self, max_tokens: int | None = None) -> Sampled:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not text for text in stop):
            raise GatewayError("a stop string must not be empty", param="stop")
        return Sampled(self.temperature, self.top_p, self.top_k, max_tokens or self.max_tokens, tuple(stop), self.n)


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict = "{}"


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[_ToolCall] | None = None


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: dict


class ChatBody(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    tools: list[_Tool] | None = None
    tool_choice: str | dict | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=0)
    echo: Literal[False] = False


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def build_app(gateway) -> FastAPI:
    """The gateway's app: every route needs ``Authorization: Bearer <gateway.api_key>``."""
    app = FastAPI(title="ppoflow rollout gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if request.headers.get("authorization") != f"Bearer {gateway.api_key}":
            return _error(401, "missing or wrong bearer token")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return _error(400, f"{where}: {first['msg']}" if where else first["msg"], where or None)

    @app.exception_handler(GatewayError)
    async def refused(request: Request, error: GatewayError):
        return _error(error.status, str(error), error.param)

    def models():
        return {"object": "list", "data": [{"id": gateway.model_name, "object": "model", "owned_by": "ppoflow"}]}

    async def chat(body: ChatBody, session_id: str | None):
        session = gateway.session(session_id)
        tools = [tool.model_dump() for tool in body.tools or []] if body.tool_choice != "none" else []
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        sampled = body.sampled(body.max_completion_tokens)
        choices, prompt_tokens = await gateway.chat(session, messages, sampled, tools)
        reply = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": gateway.model_name,
            "choices": [_chat_choice(gateway, index, c, body.logprobs) for index, c in enumerate(choices)],
            "usage": _usage(prompt_tokens, choices),
        }
        return _stream_chat(reply) if body.stream else reply

    async def complete(body: CompletionBody, session_id: str | None):
        session = gateway.session(session_id)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise GatewayError("one prompt per request (a session is one trajectory)", param="prompt")
            prompt = prompt[0]
        choices, prompt_tokens = await gateway.complete(session, prompt, body.sampled())
        reply = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": gateway.model_name,
            "choices": [_text_choice(gateway, index, c, body.logprobs is not None) for index, c in enumerate(choices)],
            "usage": _usage(prompt_tokens, choices),
        }
        return _stream_text(reply) if body.stream else reply

    for prefix in ("", "/sessions/{path_session:path}"):  # session ids may hold slashes

        def session_of(request: Request) -> str | None:
            return request.path_params.get("path_session") or request.headers.get("x-session-id")

        app.get(f"{prefix}/v1/models")(models)

        @app.post(f"{prefix}/v1/chat/completions")
        async def chat_route(body: ChatBody, request: Request):
            return await chat(body, session_of(request))

        @app.post(f"{prefix}/v1/completions")
        async def complete_route(body: CompletionBody, request: Request):
            return await complete(body, session_of(request))

    return app


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(len(c.output.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _token_texts(gateway, choice: Choice) -> list[str]:
    return [gateway.tokenizer.decode([token]) for token in choice.output.token_ids]


def _chat_choice(gateway, index: int, choice: Choice, logprobs: bool) -> dict:
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments),
            },
        }
        for call in choice.tool_calls
    ]
    message = {"role": "assistant", "content": choice.text, **({"tool_calls": calls} if calls else {})}
    content = None
    if logprobs:
        content = [
            {"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}
            for text, value in zip(_token_texts(gateway, choice), choice.output.log_probs)
        ]
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": content} if logprobs else None,
        "finish_reason": choice.finish_reason,
    }


def _text_choice(gateway, index: int, choice: Choice, logprobs: bool) -> dict:
    texts = _token_texts(gateway, choice)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {
        "index": index,
        "text": choice.text,
        "logprobs": {
            "tokens": texts,
            "token_logprobs": choice.output.log_probs,
            "top_logprobs": [{} for _ in texts],
            "text_offset": offsets,
        }
        if logprobs
        else None,
        "finish_reason": choice.finish_reason,
    }


def _events(chunks: list[dict]) -> StreamingResponse:
    """Server-sent events: each chunk, then ``[DONE]`` (a turn is sampled whole, then streamed)."""

    async def lines():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def _stream_chat(reply: dict) -> StreamingResponse:
    base = {key: reply[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = []
    for choice in reply["choices"]:
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks.append(base | {"choices": [{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"]}]})
        chunks.append(
            base | {"choices": [{"index": choice["index"], "delta": {}, "finish_reason": choice["finish_reason"]}]}
        )
    return _events(chunks)


def _stream_text(reply: dict) -> StreamingResponse:
    base = {key: reply[key] for key in ("id", "created", "model", "object")}
    return _events([base | {"choices": [choice]} for choice in reply["choices"]])
