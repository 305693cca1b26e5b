"""Agent loops: the registry and its YAML, single-turn and tool-using trajectories (on the real
continuous-batching engine, and on a scripted model where a test needs the model to call a tool), the
padded multi-turn batch, and that every loss, KL and advantage ignores the tools' tokens."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from ppoflow.algorithms.advantages import compute_gae_advantage_return, compute_grpo_outcome_advantage
from ppoflow.algorithms.kl import kl_penalty
from ppoflow.algorithms.losses import agg_loss, compute_policy_loss
from ppoflow.configs import ConfigError
from ppoflow.storage.batch import last_model_token, response_extent, trim_response_padding
from ppoflow.workers.rollout.sampling import SamplingParams
from ppoflow.workers.service.agent_loop import (
    AGENT_LOOPS,
    AgentLoop,
    AgentLoopOutput,
    AgentSettings,
    HermesParser,
    QuestionMarkParser,
    load_agent_loop_config,
    make_loops,
    outputs_to_batch,
    register,
    turn_seed,
)
from ppoflow.workers.service.requests import TokenOutput
from ppoflow.workers.service.serving import ContinuousBatchingEngine

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


def multi_turn_outputs() -> list[AgentLoopOutput]:
    """Two hand-built trajectories: model, tool, model (with EOS 2); and a single turn."""
    first = AgentLoopOutput(
        [7, 8],
        [10, 11, 20, 21, 12, 2],
        [1, 1, 0, 0, 1, 1],
        [-0.1, -0.2, 0, 0, -0.3, -0.4],
        [1, 1, -1, -1, 2, 2],
        num_turns=3,
        tool_calls=1,
        weight_versions=(4, 5),
    )
    second = AgentLoopOutput([9], [13, 2], [1, 1], [-0.5, -0.6], [1, 1], num_turns=1, weight_versions=(5, 5))
    return [first, second]


def test_outputs_pad_into_a_multi_turn_batch():
    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    assert batch["prompts"].tolist() == [[7, 8], [0, 9]] and batch["prompt_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["responses"][0].tolist() == [10, 11, 20, 21, 12, 2, 0, 0]
    assert batch["response_mask"][0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert batch["turn_ids"][0].tolist() == [1, 1, -1, -1, 2, 2, 0, 0]
    assert batch["weight_version"].tolist() == [4, 5]  # a trajectory's oldest weights
    assert batch["num_turns"].tolist() == [3, 1] and batch["tool_calls"].tolist() == [1, 0]
    assert response_extent(batch).tolist() == [6, 2] and last_model_token(batch["response_mask"]).tolist() == [5, 1]
    assert trim_response_padding(batch)["responses"].shape[1] == 6
    with pytest.raises(ValueError, match="9 response tokens > 8"):
        outputs_to_batch(
            [AgentLoopOutput([1], [3] * 9, [1] * 9, [0.0] * 9, [1] * 9, 1)],
            prompt_width=1,
            response_width=8,
            pad_token_id=0,
            weight_version=0,
        )


def test_losses_kl_and_advantages_ignore_the_tools_tokens():
    """Whatever the log-probs, advantages or values say at the tool's positions, nothing changes."""
    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    mask = batch["response_mask"]
    tool = batch["turn_ids"] < 0
    torch.manual_seed(0)
    old, new, ref = (torch.randn(2, 8) for _ in range(3))
    advantages, values = torch.randn(2, 8), torch.randn(2, 8)
    rewards = torch.zeros(2, 8)
    rewards[0, 5], rewards[1, 1] = 1.0, 0.5
    noise = torch.where(tool, torch.full((2, 8), 100.0), torch.zeros(2, 8))

    def everything(old, new, ref, advantages, values):
        loss, _ = compute_policy_loss(
            old,
            new,
            advantages,
            mask,
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=3.0,
            loss_agg_mode="token-mean",
        )
        kl = agg_loss(kl_penalty(new, ref, "low_var_kl"), mask, "token-mean")
        gae, returns = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
        grpo, _ = compute_grpo_outcome_advantage(rewards, mask, torch.tensor([0, 0]))
        return loss, kl, gae * mask, returns * mask, grpo * mask

    clean = everything(old, new, ref, advantages, values)
    noisy = everything(old + noise, new - noise, ref + noise, advantages + noise, values + noise)
    for a, b in zip(clean, noisy):
        torch.testing.assert_close(a, b)
    # GAE bridges the tool's answer: the same advantages as the trajectory with the tool's tokens cut out
    gae, _ = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.95)
    kept = [0, 1, 4, 5, 6, 7, 2, 3]  # row 0 without its tool tokens (moved to the padding's end, masked)
    cut, _ = compute_gae_advantage_return(
        torch.stack([rewards[0, kept], rewards[1]]),
        torch.stack([values[0, kept], values[1]]),
        torch.stack([mask[0, kept], mask[1]]),
        gamma=0.9,
        lam=0.95,
    )
    torch.testing.assert_close(gae[0, [0, 1, 4, 5]], cut[0, :4])


def test_turn_seeds_differ_per_turn_and_repeat_per_seed():
    assert turn_seed(7, 1) == 7 and turn_seed(7, 2) == turn_seed(7, 2) != turn_seed(7, 3)


def test_failed_tool_calls_are_counted_and_logged_for_the_run(caplog):
    from ppoflow.tasks.generate import agent_metrics

    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    import logging

    rollout_logger = logging.getLogger("ppoflow.rollout")  # the ppoflow loggers may not propagate to the root
    rollout_logger.addHandler(caplog.handler)
    try:
        metrics = agent_metrics(batch, [["vault: error: timed out"], []])
    finally:
        rollout_logger.removeHandler(caplog.handler)
    assert metrics["agent/tool_errors/count"] == 1 and metrics["agent/tool_call_ratio"] == 0.5
    assert metrics["agent/num_turns/max"] == 3 and metrics["agent/tool_calls/mean"] == 0.5
    assert "1 tool call(s) failed in this batch, e.g. vault: error: timed out" in caplog.text


def test_a_batchs_agent_loops_are_summed_up_in_one_line(caplog):
    import logging

    from ppoflow.storage.batch import with_non_tensor_columns
    from ppoflow.tasks.generate import rollout_metrics

    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    batch = with_non_tensor_columns(batch, {"tool_errors": [["vault: error: timed out"], []]})
    batch["token_level_scores"] = torch.zeros(2, 8)  # scored in the rollout service
    rollout_logger = logging.getLogger("ppoflow.rollout")
    rollout_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ppoflow.rollout"):
            rollout, _ = rollout_metrics(batch)
    finally:
        rollout_logger.removeHandler(caplog.handler)
    assert "tool_errors" not in rollout.keys()
    assert (
        "2 trajectories: 2.00 turns on average (at most 3), 1 tool call(s) in 1 of them, 1 failed; rewards "
        "scored in the rollout service as each trajectory finished, so there is no reward task"
    ) in caplog.text


def test_a_validation_sample_shows_its_turns(tiny):
    from ppoflow.flows.validation import sample_texts

    _, tokenizer = tiny
    batch = outputs_to_batch(multi_turn_outputs(), prompt_width=2, response_width=8, pad_token_id=0, weight_version=5)
    text = [tokenizer.decode(ids) for ids in ([7, 8], [9], [10, 11], [20, 21], [12], [13])]
    assert sample_texts(batch, tokenizer, [1.0, 0.0]) == [
        f"{text[0]!r} -> model {text[2]!r} | tool {text[3]!r} | model {text[4]!r} (1.00)",
        f"{text[1]!r} -> {text[5]!r} (0.00)",
    ]  # a single turn, as before


def test_a_tool_runs_generate_task_logs_its_turns_and_the_table_shows_them(
    prefect_api, ray_local, tiny_model, tmp_path
):
    """One step of the vault preset through Prefect: the generate task run's logs sum up its agent loops
    and say why there is no reward task; the metrics artifact has the agent columns."""
    import json
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterTaskRunId

    from ppoflow.flows.train import ppo_train
    from tests.conftest import drain_prefect_logs
    from tests.flow_runs import task_runs_by_name

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        "data.val_files=null",
        "data.synthetic.train_rows=16",
        "data.synthetic.copy_share=0",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
    ]
    state = ppo_train(config="vault_tool", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    flow_run_id = state.state_details.flow_run_id
    generate = task_runs_by_name(flow_run_id, ["generate[step=1]"])["generate[step=1]"]
    drain_prefect_logs()
    with get_client(sync_client=True) as client:
        for _ in range(60):  # the logs reach the server in batches
            log = "\n".join(
                record.message
                for record in client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[generate.id])))
            )
            if "16 trajectories:" in log:
                break
            time.sleep(0.5)
    assert "16 trajectories:" in log and "turns on average" in log and "tool call(s) in" in log, log
    assert "rewards scored in the rollout service" in log
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    [table] = [json.loads(artifact.data) for artifact in artifacts if artifact.key.endswith("-metrics")]
    assert {"turns", "tool_calls", "tool_errors", "staleness", "gen_s", "update_actor_s"} <= set(table[0]), table[0]
    assert table[0]["turns"] >= 1 and table[0]["tool_errors"] == 0
