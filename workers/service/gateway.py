"""The OpenAI-compatible gateway of the rollout service (``actor_rollout_ref.rollout.agent.gateway.enable``).

Each agent-loop worker serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` over HTTP
(:mod:`ppoflow.workers.service.gateway_http`) on its own event loop, behind a per-run bearer token. A request names
its session (``/sessions/{id}/v1/...`` or an ``X-Session-Id`` header); the session's turns go through the worker's
load balancer (sticky per session, weight versions recorded) and its tokens are recorded token-true
(:mod:`ppoflow.workers.service.sessions`). Details: docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import socket
from dataclasses import replace

from ppoflow.workers.rollout.requests import RequestSampling, TokenOutput
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.service.agent_loop import AgentLoopOutput, AgentSettings, turn_request
from ppoflow.workers.service.gateway_http import build_app
from ppoflow.workers.service.sessions import Choice, GatewayError, Head, Sampled, Session, choice_seed
from ppoflow.workers.service.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("ppoflow.rollout")


class Gateway:
    """The sessions of one agent-loop worker and the HTTP server that serves them."""

    def __init__(
        self,
        balancer,
        tokenizer,
        settings: AgentSettings,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        template_kwargs: dict | None = None,
    ):
        self.balancer, self.tokenizer, self.settings = balancer, tokenizer, settings
        self.model_name, self.host, self.port = model_name, host, port
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.parser = TOOL_CALL_PARSERS[settings.tool_format]
        self.template_kwargs = template_kwargs or {}
        self.sessions: dict[str, Session] = {}
        self.url: str | None = None
        self._server = None
        self._starting = asyncio.Lock()

    async def start(self) -> str:
        """Serve on this event loop (once): bind ``host:port`` (port 0: a free one) and return the base URL."""
        async with self._starting:
            if self.url is None:
                import uvicorn

                listener = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((self.host, self.port))
                config = uvicorn.Config(build_app(self), log_level="warning", lifespan="off")
                self._server = uvicorn.Server(config)
                self._task = asyncio.ensure_future(self._server.serve(sockets=[listener]))
                while not self._server.started:
                    if self._task.done():
                        self._task.result()
                    await asyncio.sleep(0.01)
                host, port = listener.getsockname()[:2]
                self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
                logger.info("OpenAI-compatible gateway serving at %s/v1", self.url)
            return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server, self.url = None, None

    def session_url(self, session_id: str) -> str:
        """The base URL an OpenAI client uses for ``session_id`` (the session is in the path)."""
        return f"{self.url}/sessions/{session_id}/v1"

    def open(self, session_id: str, *, prompt_ids: list[int], prompt, seed: int, sampling: SamplingParams) -> Session:
        """Start recording a trajectory (``prompt``: the dataset row's prompt, whose tokens are ``prompt_ids``)."""
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        session = Session(
            session_id,
            prompt_ids=prompt_ids,
            prompt=prompt,
            seed=seed,
            sampling=sampling,
            settings=self.settings,
            tokenizer=self.tokenizer,
            parser=self.parser,
            template_kwargs=self.template_kwargs,
        )
        self.sessions[session_id] = session
        return session

    def close(self, session_id: str) -> AgentLoopOutput:
        """End a session and return its trajectory; later requests naming it are refused (404)."""
        return self.sessions.pop(session_id).trajectory()

    def session(self, session_id: str | None) -> Session:
        if not session_id:
            raise GatewayError("no session: use the base URL /sessions/{id}/v1 or an X-Session-Id header")
        if session_id not in self.sessions:
            raise GatewayError(f"no open session {session_id!r}", status=404)
        return self.sessions[session_id]

    # -- requests -------------------------------------------------------------------------------------------

    async def chat(self, session: Session, messages: list[dict], sampled: Sampled, tools: list[dict] | None):
        """Sample ``sampled.n`` assistant turns after ``messages``; tool calls parsed when ``tools`` are offered.
        Returns the choices and the number of prompt tokens."""
        head = session.chat_head(messages, tools)
        choices = await self._sample(session, head, sampled, tools=tools or [])
        session.advance(
            [_extended(head, c, head.seen + [session.assistant_message(c.text, c.tool_calls)]) for c in choices]
        )
        return choices, len(head.context_ids)

    async def complete(self, session: Session, prompt: str | list[int], sampled: Sampled):
        """Sample ``sampled.n`` continuations of a completion prompt (text or token ids)."""
        head = session.text_head(prompt)
        choices = await self._sample(session, head, sampled, tools=[])
        session.advance(
            [_extended(head, c, head.seen + c.text if isinstance(head.seen, str) else None) for c in choices]
        )
        return choices, len(head.context_ids)

    async def _sample(self, session: Session, head: Head, sampled: Sampled, *, tools: list[dict]) -> list[Choice]:
        room = session.room(head)
        base = session.next_turn_seed()
        if room <= 0:  # the trajectory's response budget is spent: nothing more is sampled
            return [Choice("", [], "length", TokenOutput([], [], "length", (0, 0))) for _ in range(sampled.n)]
        request = self._request(session, sampled, budget=room, calls=bool(tools), seed=base)
        outputs = await asyncio.gather(
            *(
                self.balancer.generate(
                    session.session_id, head.context_ids, replace(request, seed=choice_seed(base, index))
                )
                for index in range(sampled.n)
            )
        )
        return [self._choice(output, sampled, tools) for output in outputs]

    def _request(self, session: Session, sampled: Sampled, *, budget: int, calls: bool, seed: int) -> RequestSampling:
        """The engine request: the OpenAI parameters given, the run's sampling for the rest; at most the
        trajectory's remaining budget and ``multi_turn.max_tokens_per_turn``; single-token stop strings (and
        the tool-call format's, when tools are offered) end the turn in the engine."""
        stop_texts = (self.parser.stop_texts() if calls else ()) + sampled.stop
        stop_ids = tuple(ids[0] for ids in map(self._ids, stop_texts) if len(ids) == 1)
        request = turn_request(session.sampling, self.settings, seed=seed, budget=budget, stop_token_ids=stop_ids)
        given = {"temperature": sampled.temperature, "top_p": sampled.top_p, "top_k": sampled.top_k}
        if sampled.temperature is not None:
            given["greedy"] = sampled.temperature == 0
        return replace(
            request,
            **{key: value for key, value in given.items() if value is not None},
            max_new_tokens=min(request.max_new_tokens, sampled.max_tokens or budget),
        )

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _choice(self, output: TokenOutput, sampled: Sampled, tools: list[dict]) -> Choice:
        """A sampled turn as the agent sees it: cut before a stop string (its tokens too: the trajectory holds
        what the agent was shown), its tool calls parsed with the configured format."""
        token_ids, finish = output.token_ids, output.finish_reason
        if sampled.stop:
            for end in range(1, len(token_ids) + 1):
                shown = self.tokenizer.decode(token_ids[:end], skip_special_tokens=True)
                if any(stop in shown for stop in sampled.stop):
                    token_ids, finish = token_ids[: end - 1], "stop"
                    break
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        calls = []
        if tools:
            text, calls = self.parser.split(text, tools)
        cut = TokenOutput(token_ids, output.log_probs[: len(token_ids)], finish, output.weight_versions)
        return Choice(text, calls, "tool_calls" if calls else finish, cut)


def _extended(head: Head, choice: Choice, seen) -> Head:
    """The head after ``choice``: its tokens appended (mask 1) with their weight versions, per turn."""
    if not choice.output.token_ids:
        return Head(seen, head.output)
    output = copy.deepcopy(head.output)
    output.add_model_turn(choice.output)
    output.extra_fields["turn_weight_versions"] = [
        *output.extra_fields.get("turn_weight_versions", []),
        list(choice.output.weight_versions),
    ]
    return Head(seen, output)
