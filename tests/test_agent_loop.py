"""Agent loops: the registry and its YAML, single-turn and tool-using trajectories (on the real
continuous-batching engine, and on a scripted model where a test needs the model to call a tool), per-turn
seeds, and how a validation sample shows its turns."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from ppoflow.configs import ConfigError
from ppoflow.workers.rollout.requests import TokenOutput
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.rollout.serving import ContinuousBatchingEngine
from ppoflow.workers.service.agent_loop import (
    AGENT_LOOPS,
    AgentLoop,
    AgentSettings,
    load_agent_loop_config,
    make_loops,
    outputs_to_batch,
    register,
    turn_seed,
)
from ppoflow.workers.service.tool_calls import HermesParser, QuestionMarkParser
from tests.agent_loop_helpers import multi_turn_outputs

SAMPLING = SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=-1, do_sample=True, max_new_tokens=8, seed=0)


class EngineClient:
    """The load balancer's interface over one in-process engine (what a replica runs)."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    async def generate(self, session_id, prompt_ids, sampling):
        self.requests.append((session_id, list(prompt_ids), sampling))
        return await asyncio.wrap_future(self.engine.submit(f"{session_id}#{len(self.requests)}", prompt_ids, sampling))


class ScriptedModel:
    """Answers each turn of a session with the next scripted text (tokenized), log-prob -0.5 a token: a
    stand-in for a trained policy where a test needs a model that calls tools."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def generate(self, session_id, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        text = self.turns.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not text.endswith("?"):
            ids.append(self.tokenizer.eos_token_id)
        ids = ids[: sampling.max_new_tokens]
        stopped = ids[-1] == self.tokenizer.eos_token_id or ids[-1] in sampling.stop_token_ids
        return TokenOutput(ids, [-0.5] * len(ids), "stop" if stopped else "length", (3, 3))


class VaultTools:
    """The tool runner's interface over the vault tool, in-process (the sandbox has its own tests)."""

    def __init__(self):
        from types import SimpleNamespace

        self.specs = {
            "vault": SimpleNamespace(
                name="vault", schema={"function": {"name": "vault", "parameters": {"type": "object", "properties": {}}}}
            )
        }
        self.calls = []

    async def call(self, name, arguments, fixed=None):
        from types import SimpleNamespace

        from ppoflow.data.vault import vault

        self.calls.append((name, arguments, fixed))
        if name != "vault":
            return SimpleNamespace(text=f"error: no tool {name}", ok=False, error="unknown tool")
        return SimpleNamespace(text=vault(**arguments, **(fixed or {})), ok=True, error=None)


def settings(**changes) -> AgentSettings:
    values = dict(
        response_length=12,
        max_assistant_turns=3,
        max_tokens_per_turn=None,
        max_tool_response_length=4,
        tool_format="question_mark",
    )
    return AgentSettings(**{**values, **changes})


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from ppoflow.workers.models import load_causal_lm, load_tokenizer
    from tests.conftest import model_config

    spec = model_config(tiny_model)
    return load_causal_lm(spec).eval(), load_tokenizer(spec)


def test_single_turn_trajectory_is_the_engines_sample(tiny):
    model, tokenizer = tiny
    engine = ContinuousBatchingEngine(model, eos_token_id=tokenizer.eos_token_id, device=torch.device("cpu"))
    client = EngineClient(engine)
    loop = make_loops(
        {"single_turn_agent"}, client=client, tokenizer=tokenizer, settings=settings(response_length=5), tools=None
    )["single_turn_agent"]
    engine.start()
    try:
        prompt = tokenizer("37>", add_special_tokens=False)["input_ids"]
        output = asyncio.run(loop.run(SAMPLING, prompt_ids=prompt, session_id="s", seed=11))
        again = asyncio.run(loop.run(SAMPLING, prompt_ids=prompt, session_id="t", seed=11))
    finally:
        engine.stop()
    assert output.prompt_ids == prompt and 1 <= len(output.response_ids) <= 5
    assert output.response_mask == [1] * len(output.response_ids) and output.num_turns == 1
    assert output.turn_ids == [1] * len(output.response_ids) and output.tool_calls == 0
    assert output.response_ids == again.response_ids  # the seed alone decides the sample
    assert client.requests[0][2].max_new_tokens == 5 and client.requests[0][2].seed == 11
    with torch.no_grad():  # the log-probs are the model's, at the sampled tokens
        ids = torch.tensor([prompt + output.response_ids])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(output.response_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(output.response_log_probs), expected, atol=1e-4, rtol=0)


def test_tool_agent_masks_the_tools_answer_and_continues(tiny):
    _, tokenizer = tiny
    model, tools = ScriptedModel(tokenizer, ["?", "58"]), VaultTools()
    loop = make_loops({"tool_agent"}, client=model, tokenizer=tokenizer, settings=settings(), tools=tools)["tool_agent"]
    prompt = tokenizer("37>", add_special_tokens=False)["input_ids"]
    output = asyncio.run(
        loop.run(SAMPLING, prompt_ids=prompt, session_id="s", seed=5, tools_kwargs={"vault": {"key": "37"}})
    )
    from ppoflow.data.vault import vault_code

    code = vault_code("37")
    answer = tokenizer(f"={code}>", add_special_tokens=False)["input_ids"]
    call = tokenizer("?", add_special_tokens=False)["input_ids"]
    final = tokenizer("58", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tools.calls == [("vault", {}, {"key": "37"})]  # the row's key, not the model's, opens the vault
    assert output.response_ids == call + answer + final
    assert output.response_mask == [1] + [0] * len(answer) + [1] * len(final)
    assert output.response_log_probs == [-0.5] + [0.0] * len(answer) + [-0.5] * len(final)
    assert output.turn_ids == [1] + [-1] * len(answer) + [2] * len(final)
    assert (output.num_turns, output.tool_calls, output.weight_versions) == (3, 1, (3, 3))
    assert model.prompts[1] == prompt + call + answer  # the second turn sees the tool's answer


def test_tool_agent_stops_at_the_turn_limit_and_the_response_budget(tiny):
    _, tokenizer = tiny
    model, tools = ScriptedModel(tokenizer, ["?"] * 5), VaultTools()
    loop = make_loops(
        {"tool_agent"}, client=model, tokenizer=tokenizer, settings=settings(max_assistant_turns=2), tools=tools
    )["tool_agent"]
    output = asyncio.run(
        loop.run(SAMPLING, prompt_ids=[5], session_id="s", seed=1, tools_kwargs={"vault": {"key": "1"}})
    )
    assert sum(1 for t in set(output.turn_ids) if t > 0) == 2 and output.tool_calls == 2
    model, tools = ScriptedModel(tokenizer, ["?"] * 5), VaultTools()
    loop = make_loops(
        {"tool_agent"},
        client=model,
        tokenizer=tokenizer,
        settings=settings(max_assistant_turns=5, response_length=6),
        tools=tools,
    )["tool_agent"]
    output = asyncio.run(
        loop.run(SAMPLING, prompt_ids=[5], session_id="s", seed=1, tools_kwargs={"vault": {"key": "1"}})
    )
    assert len(output.response_ids) == 6  # "?=X>" (4 tokens), then "?" and a cut answer: never past the budget


def test_a_turn_generates_at_most_max_tokens_per_turn(tiny):
    _, tokenizer = tiny
    model, tools = ScriptedModel(tokenizer, ["?", "58"]), VaultTools()
    loop = make_loops(
        {"tool_agent"}, client=model, tokenizer=tokenizer, settings=settings(max_tokens_per_turn=2), tools=tools
    )["tool_agent"]
    output = asyncio.run(
        loop.run(SAMPLING, prompt_ids=[5], session_id="s", seed=1, tools_kwargs={"vault": {"key": "37"}})
    )
    assert output.response_mask[-2:] == [1, 1] and output.response_ids[-1] != tokenizer.eos_token_id  # "58", cut
    single = make_loops(
        {"single_turn_agent"},
        client=ScriptedModel(tokenizer, ["12345"]),
        tokenizer=tokenizer,
        settings=settings(max_tokens_per_turn=2),
        tools=None,
    )["single_turn_agent"]
    assert len(asyncio.run(single.run(SAMPLING, prompt_ids=[5], session_id="t", seed=1)).response_ids) == 2


def test_a_failing_tool_becomes_an_error_answer(tiny):
    _, tokenizer = tiny
    model, tools = ScriptedModel(tokenizer, ["?", "1"]), VaultTools()
    tools.specs = {"missing": tools.specs["vault"]}
    tools.specs["missing"].name = "missing"
    loop = make_loops({"tool_agent"}, client=model, tokenizer=tokenizer, settings=settings(), tools=tools)["tool_agent"]
    output = asyncio.run(loop.run(SAMPLING, prompt_ids=[5], session_id="s", seed=1))
    assert output.extra_fields["tool_errors"] == ["missing: error: no tool missing"]
    assert output.tool_calls == 1 and output.response_mask[-2:] == [1, 1]


def test_hermes_parser_reads_a_json_call_and_renders_the_tool_message(tiny):
    _, tokenizer = tiny
    parser = HermesParser()
    call = parser.parse('x<tool_call>{"name": "calc", "arguments": {"a": 1}}</tool_call>', None)
    assert (call.name, call.arguments) == ("calc", {"a": 1})
    assert parser.parse("no call here", None) is None
    assert parser.parse("<tool_call>{not json</tool_call>", None).name == "<unparsable>"
    assert parser.answer_ids("12", tokenizer) == tokenizer("12", add_special_tokens=False)["input_ids"]
    assert QuestionMarkParser().parse("no call", VaultTools()) is None


def test_registry_and_yaml_declared_loops(tmp_path):
    with pytest.raises(TypeError):
        register("not_a_loop")(int)
    with pytest.raises(ValueError, match="already registered"):
        register("single_turn_agent")(type("Other", (AgentLoop,), {"run": lambda self, s, **r: None}))
    module = tmp_path / "my_loops.py"
    module.write_text(
        textwrap.dedent("""
        from ppoflow.workers.service.agent_loop import AgentLoop, AgentLoopOutput
        class Echo(AgentLoop):
            async def run(self, sampling, **row):
                return AgentLoopOutput(row["prompt_ids"], list(row["prompt_ids"]), [1] * len(row["prompt_ids"]),
                                       [0.0] * len(row["prompt_ids"]), [1] * len(row["prompt_ids"]), 1)
    """)
    )
    config = tmp_path / "loops.yaml"
    config.write_text("- name: echo_agent\n  _target_: my_loops.Echo\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        assert load_agent_loop_config(str(config)) == ["echo_agent"]
        assert AGENT_LOOPS["echo_agent"].__name__ == "Echo"
    finally:
        sys.path.remove(str(tmp_path))
        AGENT_LOOPS.pop("echo_agent", None)
    config.write_text("- name: broken\n  _target_: no_such_module.Loop\n")
    with pytest.raises(ConfigError, match="agent_loop_config_path.*broken.*cannot load"):
        load_agent_loop_config(str(config))
    with pytest.raises(ConfigError, match="no such file"):
        load_agent_loop_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="unknown agent loop.*nope"):
        make_loops({"nope"}, client=None, tokenizer=None, settings=settings(), tools=None)


def test_turn_seeds_differ_per_turn_and_repeat_per_seed():
    assert turn_seed(7, 1) == 7 and turn_seed(7, 2) == turn_seed(7, 2) != turn_seed(7, 3)


def test_a_validation_sample_shows_its_turns(tiny):
    from ppoflow.flows.validation import sample_texts

    _, tokenizer = tiny
    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    text = [tokenizer.decode(ids) for ids in ([7, 8], [9], [10, 11], [20, 21], [12], [13])]
    assert sample_texts(batch, tokenizer, [1.0, 0.0]) == [
        f"{text[0]!r} -> model {text[2]!r} | tool {text[3]!r} | model {text[4]!r} (1.00)",
        f"{text[1]!r} -> {text[5]!r} (0.00)",
    ]  # a single turn, as before
