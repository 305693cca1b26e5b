"""The ``openai_agent`` agent loop: a user's agent written against the OpenAI API, trained unmodified.

The function named by ``actor_rollout_ref.rollout.agent.agent_function.{path,name}`` is called as
``await agent(client, row, **kwargs)`` with an ``openai.AsyncOpenAI`` client whose base URL is the gateway's for this
trajectory's session; whatever it asks of the model is sampled by the replicas and recorded token-true by the
gateway. Its return value, when a string, is the final answer the scorer reads. An agent that raises or runs past
``timeout_s`` fails its trajectory (the prompt's group fails: the async modes evict and refill it).
Details: docs/gateway.md.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ppoflow.algorithms.user_code import load_object
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.service.agent_loop import AgentLoop, AgentLoopOutput, register

ROW_FIELDS = ("data_source", "extra_info", "tools_kwargs")
"""The dataset row's fields an agent sees besides its ``prompt`` (never the ground truth)."""


class AgentFailed(RuntimeError):
    """The user's agent function raised or timed out: its trajectory (and so its prompt's group) failed."""


@dataclass(frozen=True)
class AgentFunction:
    """``actor_rollout_ref.rollout.agent.agent_function``: which function, its extra keyword arguments, how
    many trajectories it runs at once per agent worker, and how long one may take."""

    path: str
    name: str | None
    kwargs: dict = field(default_factory=dict)
    max_concurrency: int = 64
    timeout_s: float = 600.0

    def load(self):
        """The agent function; a ``ValueError`` saying what is wrong when it cannot be one."""
        function = load_object(self.path, self.name, kind="function")
        if not asyncio.iscoroutinefunction(function):
            raise ValueError(f"{self.path!r}: {self.name or function!r} must be an `async def` function")
        return function


def agent_function(cfg) -> AgentFunction | None:
    """The run's ``actor_rollout_ref.rollout.agent.agent_function`` (None when it names none)."""
    spec = cfg.actor_rollout_ref.rollout.agent.agent_function
    if spec.path is None:
        return None
    return AgentFunction(spec.path, spec.name, dict(spec.kwargs), spec.max_concurrency, spec.timeout_s)


@register("openai_agent")
class OpenAIAgentLoop(AgentLoop):
    """Runs the configured agent function against the gateway, one session per trajectory."""

    def __init__(self, **shared):
        super().__init__(**shared)
        spec = self.settings.agent_function
        if self.gateway is None or spec is None:
            raise ValueError(
                "the openai_agent loop needs actor_rollout_ref.rollout.agent.gateway.enable=true and "
                "actor_rollout_ref.rollout.agent.agent_function.path"
            )
        self.spec, self.function = spec, spec.load()
        self.running = asyncio.Semaphore(spec.max_concurrency)
        self.http = None
        """One HTTP connection pool for every session's client (a client of its own costs far more than a turn)."""

    async def run(self, sampling: SamplingParams, **row) -> AgentLoopOutput:
        import httpx
        import openai

        await self.gateway.start()
        if self.http is None:
            self.http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.spec.timeout_s), limits=httpx.Limits(max_connections=None)
            )
        session_id = row["session_id"]
        prompt = row.get("raw_prompt")
        if prompt is None:  # prompts sent without the dataset's text: their tokens, decoded
            prompt = self.tokenizer.decode(row["prompt_ids"], skip_special_tokens=True)
        agent_row = {"prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt}
        agent_row |= {key: row.get(key) for key in ROW_FIELDS}
        async with self.running:
            self.gateway.open(
                session_id, prompt_ids=list(row["prompt_ids"]), prompt=prompt, seed=row["seed"], sampling=sampling
            )
            client = openai.AsyncOpenAI(
                base_url=self.gateway.session_url(session_id),
                api_key=self.gateway.api_key,
                max_retries=0,
                http_client=self.http,
            )
            try:
                answer = await asyncio.wait_for(
                    self.function(client, agent_row, **self.spec.kwargs), self.spec.timeout_s
                )
            except TimeoutError:
                raise AgentFailed(
                    f"agent function timed out after {self.spec.timeout_s} s (session {session_id})"
                ) from None
            except Exception as error:  # noqa: BLE001 - the user's agent may raise anything
                raise AgentFailed(
                    f"agent function raised {type(error).__name__}: {error} (session {session_id})"
                ) from error
            finally:
                output = self.gateway.close(session_id)
        if isinstance(answer, str):
            output.extra_fields["final_answer"] = answer
        return output
