"""The gateway inside the rollout service (real Ray, a real replica): an agent-loop worker serves it over HTTP
behind the run's token, the ``openai_agent`` loop's trajectories are scored with the agent's final answer and
recorded and replayed by the per-sample cache (``skip.async_rollout``), a malformed request is refused (400) while
the agent goes on, and an agent that raises fails its group."""

from __future__ import annotations

import openai
import pytest
import torch
from tensordict import TensorDict

from ppoflow.configs import ConfigError, load_config
from ppoflow.storage.batch import non_tensor_column, with_non_tensor_columns
from ppoflow.workers.rollout.sampling import SamplingParams
from tests.preflight_helpers import DEMO_TRAIN

AGENT = """
import openai

async def agent(client, row, *, log):
    if row["prompt"][0]["content"].endswith("!"):
        raise RuntimeError("this agent cannot answer " + row["prompt"][0]["content"])
    try:  # a malformed request is refused with a 400; the agent and the run go on
        await client.chat.completions.create(model="any", messages=row["prompt"], temperature=5)
    except openai.BadRequestError as error:
        with open(log, "a") as calls:
            calls.write(row["prompt"][0]["content"] + f"={error.status_code}\\n")
    reply = await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=3)
    return "12" if row["extra_info"]["answer_given"] else reply.choices[0].message.content
"""


def config(tiny_model: str, tmp_path, *more: str):
    (tmp_path / "agent.py").write_text(AGENT)
    return load_config(
        "grpo_tiny",
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
            "actor_rollout_ref.rollout.agent.gateway.enable=true",
            f"actor_rollout_ref.rollout.agent.agent_function.path={tmp_path / 'agent.py'}",
            "actor_rollout_ref.rollout.agent.agent_function.name=agent",
            f"actor_rollout_ref.rollout.agent.agent_function.kwargs.log={tmp_path / 'calls.log'}",
            "data.max_response_length=6",
            *more,
        ],
    )


def prompts(texts: list[str], tokenizer, first_sample: int) -> TensorDict:
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, rows))
    batch = TensorDict(
        {
            "prompts": torch.tensor([[0] * (width - len(r)) + r for r in rows]),
            "prompt_mask": torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows]),
        },
        batch_size=[len(rows)],
    )
    return with_non_tensor_columns(
        batch,
        {
            "raw_prompt": texts,
            "sample_id": [f"sample_0_{first_sample + i}" for i in range(len(rows))],
            "data_source": ["synthetic/copy"] * len(rows),
            "ground_truth": ["12"] * len(rows),
            "extra_info": [{"answer_given": i == 0} for i in range(len(rows))],
        },
    )


def test_the_openai_agent_loop_runs_in_the_service_and_its_groups_replay(ray_local, tiny_model, tmp_path):
    from ppoflow.workers.models import load_tokenizer
    from ppoflow.workers.service.agent_worker import AgentLoopWorker
    from ppoflow.workers.service.replicas import RolloutReplica
    from ppoflow.workers.service.rollout_service import RolloutService

    cfg = config(
        tiny_model,
        tmp_path,
        "skip.async_rollout.enable=true",
        f"skip.async_rollout.dump_dir={tmp_path / 'cache'}",
        "skip.async_rollout.steps=[1,2]",
    )
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    replica = ray_local.remote(RolloutReplica).options(num_cpus=0).remote(cfg)
    worker = ray_local.remote(AgentLoopWorker).options(num_cpus=0).remote(cfg, [replica], gateway_token="run-token")
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, do_sample=True, max_new_tokens=6, seed=3)
    try:
        url = ray_local.get(worker.gateway_url.remote())
        assert url.startswith("http://127.0.0.1:")
        assert RolloutService([replica], [worker], pad_token_id=0).gateway_urls() == [url]
        with pytest.raises(openai.AuthenticationError):  # served over HTTP, behind the run's token
            openai.OpenAI(base_url=f"{url}/v1", api_key="guess", max_retries=0).models.list()
        served = openai.OpenAI(base_url=f"{url}/v1", api_key="run-token", max_retries=0)
        assert [model.id for model in served.models.list().data] == ["tiny_llama"]
        with pytest.raises(openai.NotFoundError, match="no open session"):
            served.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "1"}], extra_headers={"X-Session-Id": "nobody"}
            )

        batch = prompts(["12>", "34>"], tokenizer, first_sample=1)
        first = ray_local.get(
            worker.generate.remote(batch, first_position=0, step=1, sampling=sampling, weight_version=0)
        )
        assert sorted((tmp_path / "calls.log").read_text().split()) == ["12>=400"] * 2 + ["34>=400"] * 2
        assert non_tensor_column(first, "sample_cache") == ["miss"] * 4
        scores = first["token_level_scores"].sum(-1).tolist()
        assert scores[:2] == [1.0, 1.0]  # the agent's final answer is what the scorer read
        assert int(first["response_mask"].sum()) > 0 and first["num_turns"].tolist() == [1] * 4

        again = ray_local.get(
            worker.generate.remote(batch, first_position=0, step=1, sampling=sampling, weight_version=5)
        )
        assert (
            sorted((tmp_path / "calls.log").read_text().split()) == ["12>=400"] * 2 + ["34>=400"] * 2
        )  # the agent never ran
        assert non_tensor_column(again, "sample_cache") == ["hit"] * 4
        for name in ("responses", "response_mask", "rollout_log_probs", "token_level_scores", "turn_ids"):
            assert torch.equal(again[name], first[name]), name
        assert again["weight_version"].tolist() == [5] * 4

        failing = prompts(["5!"], tokenizer, first_sample=7)
        with pytest.raises(Exception, match="this agent cannot answer 5!") as failed:
            ray_local.get(
                worker.generate.remote(failing, first_position=9, step=1, sampling=sampling, weight_version=5)
            )
        assert "AgentFailed" in repr(failed.value)
        assert ray_local.get(worker.gateway_url.remote()) == url  # the worker serves on
    finally:
        ray_local.kill(worker)
        ray_local.kill(replica)


def test_the_gateway_and_openai_agent_are_checked_before_anything_starts(tiny_model, tmp_path):
    with pytest.raises(ConfigError) as raised:
        load_config("grpo_tiny", ["actor_rollout_ref.rollout.agent.gateway.enable=true"])
    assert raised.value.problems == [
        ("actor_rollout_ref.rollout.agent.gateway.enable", "the gateway needs rollout.mode=async")
    ]
    with pytest.raises(ConfigError) as raised:
        load_config(
            "grpo_tiny",
            [
                "actor_rollout_ref.rollout.mode=async",
                "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
                "actor_rollout_ref.rollout.agent.gateway.port=8000",
                "actor_rollout_ref.rollout.agent.num_workers=2",
            ],
        )
    keys = [key for key, _ in raised.value.problems]
    assert keys == [
        "actor_rollout_ref.rollout.agent.gateway.enable",
        "actor_rollout_ref.rollout.agent.agent_function.path",
        "actor_rollout_ref.rollout.agent.gateway.port",
    ]
    from ppoflow.flows.preflight import _agent_problems

    cfg = config(tiny_model, tmp_path, "actor_rollout_ref.rollout.agent.agent_function.name=missing")
    assert _agent_problems(cfg) == [
        ("actor_rollout_ref.rollout.agent.agent_function", f"{str(tmp_path / 'agent.py')!r} has no function 'missing'")
    ]
    assert _agent_problems(config(tiny_model, tmp_path)) == []


FLAKY_AGENT = """
async def agent(client, row):
    text = row["prompt"][0]["content"]
    reply = await client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=4)
    if text[0] in "0123":
        raise RuntimeError("this agent fails on " + text)
    return reply.choices[0].message.content
"""


@pytest.mark.slow  # a CLI run of ~1 min
def test_an_async_run_evicts_and_refills_the_groups_whose_agent_failed(prefect_server, tiny_model, tmp_path):
    """colocate_async with the openai_agent loop, its agent failing on the prompts that start with 0-3: those
    groups are evicted and refilled (training/rollout_failure/evicted_samples), the run trains on to the end."""
    import subprocess

    from ppoflow.flows.tracking import read_metrics
    from tests.async_modes_helpers import run_overrides

    (tmp_path / "agent.py").write_text(FLAKY_AGENT)
    words = [
        "trainer.v1.trainer_mode=colocate_async",
        "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent",
        "actor_rollout_ref.rollout.agent.gateway.enable=true",
        f"actor_rollout_ref.rollout.agent.agent_function.path={tmp_path}/agent.py",
        "actor_rollout_ref.rollout.agent.agent_function.name=agent",
    ]
    done = subprocess.run(
        [
            *DEMO_TRAIN,
            *run_overrides(tiny_model, tmp_path, *words),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(f"{tmp_path}/run")
    assert len(rows) == 3, rows
    assert sum(row.get("training/rollout_failure/evicted_samples", 0) for row in rows) > 0, rows
