"""The OpenAI-compatible gateway, driven with the real ``openai`` client package over HTTP: chat and text
completions, streaming, tool calls in OpenAI's format, refused requests (4xx, the gateway serves on), token-true
trajectories (edited history starts a new segment), and the ``openai_agent`` loop, whose vault agent written
against the OpenAI SDK produces exactly ``tool_agent``'s trajectory."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from ppoflow.data.vault import vault_code
from ppoflow.workers.rollout.serving import ContinuousBatchingEngine
from ppoflow.workers.service.agent_loop import make_loops, turn_seed
from ppoflow.workers.service.gateway import Gateway
from ppoflow.workers.service.openai_agent import AgentFailed, AgentFunction
from tests.test_agent_loop import SAMPLING, EngineClient, ScriptedModel, VaultTools, settings

VAULT_AGENT = AgentFunction("ppoflow.data.vault_agent:agent", None, max_concurrency=4, timeout_s=30)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from ppoflow.workers.models import load_causal_lm, load_tokenizer
    from tests.conftest import model_config

    spec = model_config(tiny_model)
    return load_causal_lm(spec).eval(), load_tokenizer(spec)


@pytest.fixture
def engine(tiny):
    model, tokenizer = tiny
    engine = ContinuousBatchingEngine(model, eos_token_id=tokenizer.eos_token_id, device=torch.device("cpu"))
    engine.start()
    yield EngineClient(engine)
    engine.stop()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_both(client, tokenizer, *, seed: int, prompt: str = "37>", raw_prompt: bool = True, **changes):
    """The same vault row through tool_agent and through the OpenAI-SDK vault agent behind the gateway."""
    agent_settings = settings(max_assistant_turns=2, max_tokens_per_turn=3, agent_function=VAULT_AGENT, **changes)
    row = dict(prompt_ids=ids(tokenizer, prompt), seed=seed, tools_kwargs={"vault": {"key": prompt[:-1]}})

    async def both():
        gateway = Gateway(client, tokenizer, agent_settings, model_name="tiny")
        loops = make_loops(
            {"tool_agent", "openai_agent"},
            client=client,
            tokenizer=tokenizer,
            settings=agent_settings,
            tools=VaultTools(),
            gateway=gateway,
        )
        try:
            built_in = await loops["tool_agent"].run(SAMPLING, session_id="a", **row)
            text = {"raw_prompt": prompt} if raw_prompt else {}  # without it, the prompt's tokens decoded
            through_gateway = await loops["openai_agent"].run(SAMPLING, session_id="b", **text, **row)
        finally:
            await gateway.stop()
        return built_in, through_gateway

    return asyncio.run(both())


def test_the_openai_vault_agent_gives_tool_agents_trajectory(tiny, engine):
    _, tokenizer = tiny
    model = ScriptedModel(tokenizer, ["?", "58", "?", "58"])  # a policy that calls the tool, then answers
    built_in, gateway = run_both(model, tokenizer, seed=5)
    code = vault_code("37")
    assert built_in.response_ids == ids(tokenizer, f"?={code}>58") + [tokenizer.eos_token_id]
    for name in ("prompt_ids", "response_ids", "response_mask", "response_log_probs", "turn_ids", "tool_calls"):
        assert getattr(gateway, name) == getattr(built_in, name), name
    assert gateway.extra_fields["final_answer"] == "58" and gateway.extra_fields["segments"] == 1
    assert gateway.extra_fields["turn_weight_versions"] == [[3, 3], [3, 3]]
    assert model.prompts[2:] == model.prompts[:2]  # fed the very same tokens, turn by turn
    for seed in (1, 2, 3):  # on the real engine: the same tokens, log-probs and seeds per turn
        built_in, gateway = run_both(engine, tokenizer, seed=seed, raw_prompt=seed != 3)
        assert (gateway.response_ids, gateway.response_log_probs) == (
            built_in.response_ids,
            built_in.response_log_probs,
        )
    seeds = [request[2].seed for request in engine.requests]
    assert seeds[:2] == [turn_seed(1, 1), turn_seed(1, 1)]


async def _client(gateway: Gateway, session_id: str, **kwargs) -> openai.AsyncOpenAI:
    await gateway.start()
    return openai.AsyncOpenAI(
        base_url=gateway.session_url(session_id), api_key=gateway.api_key, max_retries=0, **kwargs
    )


def test_the_openai_client_talks_to_the_gateway(tiny, engine):
    _, tokenizer = tiny
    agent_settings = settings(response_length=12)

    async def talk():
        gateway = Gateway(engine, tokenizer, agent_settings, model_name="tiny")
        gateway.open("s", prompt_ids=ids(tokenizer, "12>"), prompt="12>", seed=7, sampling=SAMPLING)
        client = await _client(gateway, "s")
        try:
            models = await client.models.list()
            reply = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "12>"}], max_tokens=3, logprobs=True, n=2
            )
            refused = []
            for bad in (
                dict(messages=[]),
                dict(messages=[{"role": "user", "content": "1"}], temperature=5),
                dict(messages=[{"role": "robot", "content": "1"}]),
            ):
                with pytest.raises(openai.BadRequestError) as error:
                    await client.chat.completions.create(model="tiny", **bad)
                refused.append(error.value.body["message"])
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "12>"}, reply.choices[0].message.model_dump(exclude_none=True)]
                + [{"role": "user", "content": "3"}],
                max_tokens=2,
                stream=True,
            )
            streamed = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
            chat = gateway.sessions["s"].heads[0].output
            text = await client.completions.create(model="tiny", prompt="12>", max_tokens=2, logprobs=0)
            with pytest.raises(openai.NotFoundError):
                await (await _client(gateway, "nobody")).chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "1"}]
                )
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(
                    base_url=gateway.session_url("s"), api_key="wrong", max_retries=0
                ).models.list()
            async with httpx.AsyncClient() as raw:
                unauthorised = await raw.get(f"{gateway.url}/v1/models")
            return models, reply, refused, (streamed, chat), text, unauthorised, gateway.close("s")
        finally:
            await gateway.stop()

    models, reply, refused, (streamed, chat), text, unauthorised, trajectory = asyncio.run(talk())
    assert [model.id for model in models.data] == ["tiny"]
    assert len(reply.choices) == 2 and all(len(c.logprobs.content) <= 3 for c in reply.choices)
    assert reply.usage.prompt_tokens == 3
    assert refused[0].startswith("messages:") and refused[1].startswith("temperature:") and "role" in refused[2]
    assert text.choices[0].logprobs.token_logprobs is not None
    assert unauthorised.status_code == 401
    last_turn = [token for token, turn in zip(chat.response_ids, chat.turn_ids) if turn == 2]
    assert streamed == tokenizer.decode(last_turn, skip_special_tokens=True)  # the streamed turn is the recorded one
    assert chat.turn_ids.count(-1) == len(ids(tokenizer, "3"))  # the user's "3" between the turns, mask 0
    # the text completion restarted from "12>", which extends no chat head: a new segment, and the trajectory
    assert trajectory.extra_fields["segments"] == 2 and trajectory.prompt_ids == ids(tokenizer, "12>")
    assert text.choices[0].text == tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)


def test_the_trajectory_is_token_true_and_edited_history_starts_a_segment(tiny, engine):
    _, tokenizer = tiny
    prompt = ids(tokenizer, "12>")

    async def converse():
        gateway = Gateway(engine, tokenizer, settings(response_length=12), model_name="tiny")
        gateway.open("s", prompt_ids=prompt, prompt="12>", seed=3, sampling=SAMPLING)
        client = await _client(gateway, "s")
        messages = [{"role": "user", "content": "12>"}]
        try:
            first = await client.chat.completions.create(model="t", messages=messages, max_tokens=3)
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "4"})
            second = await client.chat.completions.create(model="t", messages=messages, max_tokens=3)
            kept = gateway.sessions["s"].heads[0].output
            messages[1] = {"role": "assistant", "content": "edited"}
            third = await client.chat.completions.create(model="t", messages=messages, max_tokens=2)
            return first, second, kept, third, gateway.close("s")
        finally:
            await gateway.stop()

    first, second, kept, third, trajectory = asyncio.run(converse())
    fed = [request[1] for request in engine.requests]
    four = ids(tokenizer, "4")
    assert kept.prompt_ids == prompt  # the row's own tokens, not the chat re-rendered
    first_turn = kept.turn_ids.count(1)
    second_turn = kept.turn_ids.count(2)
    assert kept.response_mask == [1] * first_turn + [0] * len(four) + [1] * second_turn  # only sampled tokens train
    assert kept.response_ids[first_turn : first_turn + len(four)] == four
    assert fed[1] == prompt + kept.response_ids[: first_turn + len(four)]  # fed exactly what was sampled, then "4"
    assert first.choices[0].message.content == tokenizer.decode(
        kept.response_ids[:first_turn], skip_special_tokens=True
    )
    assert second.choices[0].message.content == tokenizer.decode(
        kept.response_ids[first_turn + len(four) :], skip_special_tokens=True
    )
    # the edited conversation is a new segment: its prompt is the whole conversation rendered, only the new turn trains
    assert trajectory.extra_fields["segments"] == 2
    assert trajectory.prompt_ids == fed[2] == ids(tokenizer, "12>edited4")
    assert trajectory.response_mask == [1] * len(trajectory.response_ids) and 1 <= len(trajectory.response_ids) <= 2
    assert third.choices[0].message.content == tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
    assert [request[2].max_new_tokens for request in engine.requests] == [3, 3, 2]


def test_an_agent_that_raises_or_hangs_fails_its_trajectory(tmp_path, tiny, engine):
    _, tokenizer = tiny
    (tmp_path / "agents.py").write_text(
        "import asyncio\n"
        "async def broken(client, row):\n    raise KeyError('no such field')\n"
        "async def slow(client, row):\n    await asyncio.sleep(60)\n"
    )

    async def run(name):
        agent_settings = settings(agent_function=AgentFunction(str(tmp_path / "agents.py"), name, timeout_s=0.5))
        gateway = Gateway(engine, tokenizer, agent_settings, model_name="tiny")
        loop = make_loops(
            {"openai_agent"}, client=engine, tokenizer=tokenizer, settings=agent_settings, gateway=gateway
        )
        try:
            await loop["openai_agent"].run(SAMPLING, session_id="s", prompt_ids=[5], seed=1, raw_prompt="1")
        finally:
            assert gateway.sessions == {}  # closed whatever happened
            await gateway.stop()

    with pytest.raises(AgentFailed, match="raised KeyError"):
        asyncio.run(run("broken"))
    with pytest.raises(AgentFailed, match="timed out"):
        asyncio.run(run("slow"))
    with pytest.raises(ValueError, match="async def"):
        AgentFunction("ppoflow.data.vault:vault", None).load()


def test_with_a_chat_template_added_messages_and_new_segments_are_templated(tiny):
    import copy

    from ppoflow.workers.service.sessions import Sampled

    tokenizer = copy.deepcopy(tiny[1])
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
    )
    model = ScriptedModel(tokenizer, ["3", "5", "6"])  # each turn ends with EOS

    async def converse():
        gateway = Gateway(model, tokenizer, settings(response_length=12), model_name="tiny")
        asked = [{"role": "user", "content": "12"}]
        gateway.open("s", prompt_ids=ids(tokenizer, "12|a:"), prompt=asked, seed=1, sampling=SAMPLING)
        session = gateway.sessions["s"]
        (first,), _ = await gateway.chat(session, asked, Sampled(), None)
        asked += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "4"}]
        await gateway.chat(session, asked, Sampled(), None)
        continued = session.heads[0].output
        asked[1]["content"] = "9"  # the agent rewrites the model's turn
        await gateway.chat(session, asked, Sampled(), None)
        return continued, gateway.close("s")

    continued, trajectory = asyncio.run(converse())
    eos = [tokenizer.eos_token_id]
    assert model.prompts[0] == ids(tokenizer, "12|a:")  # the row's tokens
    assert model.prompts[1] == ids(tokenizer, "12|a:3") + eos + ids(tokenizer, "4|a:")  # the added turn, templated
    assert continued.response_mask == [1, 1] + [0] * 4 + [1, 1]
    assert model.prompts[2] == trajectory.prompt_ids == ids(tokenizer, "12|9|4|a:")  # a new segment, all templated
    assert trajectory.response_ids == ids(tokenizer, "6") + eos and trajectory.extra_fields["segments"] == 2


def test_tool_calls_come_back_in_openais_format_streamed_or_not(tiny):
    from ppoflow.data.vault_agent import VAULT_TOOL

    _, tokenizer = tiny
    model = ScriptedModel(tokenizer, ["?", "?", "12"])

    async def call():
        gateway = Gateway(model, tokenizer, settings(), model_name="tiny")
        gateway.open("s", prompt_ids=ids(tokenizer, "37>"), prompt="37>", seed=1, sampling=SAMPLING)
        client = await _client(gateway, "s")
        asked = [{"role": "user", "content": "37>"}]
        try:
            reply = await client.chat.completions.create(model="t", messages=asked, tools=[VAULT_TOOL])
            stream = await client.chat.completions.create(model="t", messages=asked, tools=[VAULT_TOOL], stream=True)
            chunks = [chunk async for chunk in stream]
            plain = await client.chat.completions.create(model="t", messages=asked, tools=[VAULT_TOOL])
            return reply, chunks, plain
        finally:
            await gateway.stop()

    reply, chunks, plain = asyncio.run(call())
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (called,) = choice.message.tool_calls
    assert (called.type, called.function.name, called.function.arguments) == ("function", "vault", "{}")
    assert called.id.startswith("call_")
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert deltas[0].tool_calls[0].function.name == "vault" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content == "12"
    assert plain.choices[0].finish_reason == "stop"
