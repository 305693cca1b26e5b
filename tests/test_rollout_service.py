"""The rollout service (``actor_rollout_ref.rollout.mode=async``) on a real local Ray: replicas behind the load
balancer (sticky sessions, spread load, a killed replica's requests served elsewhere), whole runs through
Prefect with single-turn and tool-using agent loops, and its config errors before anything starts."""

from __future__ import annotations

import asyncio
import time

import pytest

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.preflight import preflight
from ppoflow.flows.tracking import read_metrics
from ppoflow.workers.rollout.requests import RequestSampling

SAMPLING = RequestSampling(
    temperature=1.0, top_p=1.0, top_k=-1, greedy=False, max_new_tokens=6, seed=0, ignore_eos=True
)


@pytest.fixture(scope="module")
def replicas(ray_local, tiny_model, tmp_path_factory):
    """Two replicas of the tiny model (restartable, as the run starts them)."""
    from ppoflow.workers.service.replicas import RolloutReplica

    cfg = load_config(
        "grpo_tiny", [f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.mode=async"]
    )
    handles = [
        ray_local.remote(RolloutReplica).options(num_cpus=0, max_restarts=1, max_task_retries=0).remote(cfg)
        for _ in range(2)
    ]
    ray_local.get([handle.__ray_ready__.remote() for handle in handles])
    yield handles
    for handle in handles:
        ray_local.kill(handle)


def serving_version(ray, replica, timeout_s: float = 60.0) -> int:
    """The replica's weight version once it answers (Ray may still be restarting it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(replica.weight_version.remote())
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the replica did not come back"
            time.sleep(0.2)


def admitted(ray, handles) -> list[int]:
    return [stats["requests_admitted"] for stats in ray.get([h.stats.remote() for h in handles])]


def test_sessions_stick_to_a_replica_and_load_spreads(ray_local, replicas):
    from ppoflow.workers.service.replicas import LoadBalancer

    balancer = LoadBalancer(replicas)
    before = admitted(ray_local, replicas)

    async def session(name: str):
        first = await balancer.generate(name, [5, 6, 7], SAMPLING)
        await balancer.generate(name, [5, 6, 7] + first.token_ids, SAMPLING)  # a second turn
        return balancer.sessions[name]

    async def sessions():
        return await asyncio.gather(*(session(f"s{i}") for i in range(8)))

    placed = asyncio.run(sessions())
    after = admitted(ray_local, replicas)
    assert sorted(set(placed)) == [0, 1]  # both replicas took sessions
    assert [a - b for a, b in zip(after, before)] == [2 * placed.count(0), 2 * placed.count(1)]  # turns stayed
    assert balancer.in_flight == [0, 0]


@pytest.mark.slow  # a replica killed and its requests moved (~8 s)
def test_requests_on_a_killed_replica_are_served_by_another(ray_local, replicas):
    from ppoflow.workers.service.replicas import LoadBalancer

    balancer = LoadBalancer(replicas)
    long = RequestSampling(
        temperature=1.0, top_p=1.0, top_k=-1, greedy=False, max_new_tokens=40, seed=1, ignore_eos=True
    )

    async def run():
        requests = [asyncio.ensure_future(balancer.generate(f"k{i}", [5, 6], long)) for i in range(6)]
        await asyncio.sleep(0.2)
        ray_local.kill(replicas[0], no_restart=False)  # Ray restarts it; its requests in flight fail
        return await asyncio.gather(*requests)

    outputs = asyncio.run(run())
    assert all(len(output.token_ids) == 40 for output in outputs)
    assert serving_version(ray_local, replicas[0]) == 0  # back, with its initial weights


@pytest.mark.slow  # a replica restart (~10 s)
def test_a_restarted_replica_gets_the_last_weights_before_the_next_batch(ray_local, replicas, tiny_model):
    from ppoflow.workers.models import load_causal_lm
    from ppoflow.workers.service.rollout_service import RolloutService
    from ppoflow.workers.weight_sync import WeightSender

    cfg = load_config(
        "grpo_tiny", [f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.mode=async"]
    )
    service = RolloutService(replicas, agents=[], pad_token_id=0)
    update, _ = WeightSender(cfg.actor_rollout_ref.rollout.weight_sync).prepare(
        load_causal_lm(cfg.actor_rollout_ref.model).state_dict(), 7
    )
    for replica in replicas:  # an earlier test killed one: Ray may still be bringing it back
        serving_version(ray_local, replica)
    assert ray_local.get(service.start_apply_weights(update)) == [7, 7]
    ray_local.kill(replicas[1], no_restart=False)  # Ray restarts it with its initial weights
    time.sleep(0.5)
    assert serving_version(ray_local, replicas[1]) == 0
    service.resync_restarted()  # what generate() does first
    assert ray_local.get([replica.weight_version.remote() for replica in replicas]) == [7, 7]


@pytest.mark.slow  # ~10 s; the vault run below goes through the service's agent workers by default
def test_the_service_spreads_a_batch_over_agent_workers_in_prompt_order(ray_local, replicas, tiny_model):
    import torch
    from tensordict import TensorDict

    from ppoflow.workers.rollout.sampling import SamplingParams
    from ppoflow.workers.service.agent_worker import AgentLoopWorker
    from ppoflow.workers.service.rollout_service import RolloutService

    cfg = load_config(
        "grpo_tiny", [f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.mode=async"]
    )
    agents = [ray_local.remote(AgentLoopWorker).options(num_cpus=0).remote(cfg, replicas) for _ in range(2)]
    service = RolloutService(replicas, agents, pad_token_id=0)
    prompts = TensorDict(
        {
            "prompts": torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4]]),
            "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool),
        },
        batch_size=[3],
    )
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, do_sample=True, max_new_tokens=3, seed=4)
    batch = service.generate(prompts, step=7, sampling=sampling)
    again = service.generate(prompts, step=7, sampling=sampling)
    assert batch["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["prompts"].tolist() == prompts["prompts"].repeat_interleave(2, dim=0).tolist()
    assert batch["responses"].shape == (6, 3) and batch["turn_ids"].shape == (6, 3)
    assert batch["responses"].tolist() == again["responses"].tolist()  # seeded per trajectory, not per schedule
    assert batch["num_turns"].tolist() == [1] * 6
    assert "token_level_scores" not in batch.keys()  # no data sources sent: the reward stage scores
    # with each prompt's data source and ground truth, every trajectory is scored as soon as it finishes
    from ppoflow.algorithms.scoring import copy_score, solution_text
    from ppoflow.storage.batch import with_non_tensor_columns
    from ppoflow.workers.models import load_tokenizer

    with_truths = with_non_tensor_columns(
        prompts.clone(), {"data_source": ["synthetic/copy"] * 3, "ground_truth": ["12", "34", "5"]}
    )
    scored = service.generate(with_truths, step=7, sampling=sampling)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    expected = [
        copy_score("synthetic/copy", solution_text(ids[: int(mask.sum())], tokenizer), truth)
        for ids, mask, truth in zip(
            scored["responses"].tolist(), scored["response_mask"], ["12", "12", "34", "34", "5", "5"]
        )
    ]
    assert scored["token_level_scores"].sum(dim=1).tolist() == pytest.approx([e["score"] for e in expected])
    assert [extras["exact"] for extras in scored["reward_extras"].tolist()] == [e["exact"] for e in expected]
    for agent in agents:
        ray_local.kill(agent)


@pytest.mark.parametrize(
    "preset, words",
    [
        pytest.param(
            "grpo_tiny",
            [
                "actor_rollout_ref.rollout.mode=async",
                "actor_rollout_ref.rollout.num_replicas=2",
                "actor_rollout_ref.rollout.agent.num_workers=2",
            ],
            marks=pytest.mark.slow,
        ),
        ("vault_tool", ["data.synthetic.copy_share=0"]),  # vault rows only: every trajectory may call the tool
        pytest.param(  # verl's layout: the replicas are the engines of the actor's two ranks, asleep while they train
            "vault_tool",
            [
                "data.synthetic.copy_share=0",
                "actor_rollout_ref.hybrid_engine=true",
                "trainer.n_cpu_ranks_per_node=2",
                "actor_rollout_ref.actor.resources.num_cpus=0.5",
            ],
            id="vault_tool-colocated-2-ranks",
        ),
    ],
)
def test_a_run_with_the_rollout_service(prefect_api, ray_local, tiny_model, tmp_path, preset, words):
    """Two steps through Prefect: the stage batch and the agent metrics; in the vault run, the random model
    calls the tool now and then, and the answers come back masked."""
    from ppoflow.flows.train import ppo_train

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        "data.val_files=null",
        "data.synthetic.train_rows=64",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
        *words,
    ]
    state = ppo_train(config=preset, overrides=overrides, return_state=True)
    assert state.is_completed(), state
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["agent/num_turns/mean"] >= 1 and row["agent/tool_errors/count"] == 0
        assert row["response_length/mean"] > 0
        # scored while generating: no reward stage, the scorer's extras still reported
        assert "timing_s/reward" not in row and "reward/exact/mean" in row
        assert row["training/off_policy/trajectory_staleness/max"] == 0  # every turn from the weights trained now
    if "actor_rollout_ref.hybrid_engine=true" in words:  # each rank's engine woke to generate and slept to train
        assert all(row["perf/actor/rollout_sleep_after_gb"] > 0 for row in rows)
    if preset == "vault_tool":
        assert sum(row["agent/tool_calls/mean"] for row in rows) > 0
        assert max(row["agent/num_turns/max"] for row in rows) >= 3  # call, answer, another turn


@pytest.mark.parametrize(
    "words, key, needle",
    [
        (
            ["actor_rollout_ref.rollout.agent.default_agent_loop=no_such_loop"],
            "actor_rollout_ref.rollout.agent.default_agent_loop",
            "unknown agent loop 'no_such_loop'",
        ),
        (
            ["actor_rollout_ref.rollout.multi_turn.tool_config_path=/nonexistent/tools.yaml"],
            "actor_rollout_ref.rollout.multi_turn.tool_config_path",
            "/nonexistent/tools.yaml",
        ),
    ],
)
def test_agent_settings_are_checked_before_anything_starts(tiny_model, tmp_path, words, key, needle):
    cfg = load_config(
        "vault_tool",
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            f"data.train_files={tmp_path}/train.parquet",
            "data.val_files=null",
            "trainer.test_freq=-1",
            f"trainer.default_local_dir={tmp_path}/run",
            *words,
        ],
    )
    with pytest.raises(ConfigError) as raised:
        preflight(cfg)
    assert any(k == key and needle in message for k, message in raised.value.problems), raised.value.problems


def test_a_tool_whose_function_does_not_import_is_a_config_error(tiny_model, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n  - function: 'no_such_module_here:f'\n    tool_schema:\n      type: function\n"
        "      function: {name: f, description: x, parameters: {type: object, properties: {}}}\n"
    )
    cfg = load_config(
        "vault_tool",
        [
            f"actor_rollout_ref.model.path={tiny_model}",
            f"data.train_files={tmp_path}/train.parquet",
            "data.val_files=null",
            "trainer.test_freq=-1",
            f"trainer.default_local_dir={tmp_path}/run",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        ],
    )
    with pytest.raises(ConfigError) as raised:
        preflight(cfg)
    assert any(
        key == "actor_rollout_ref.rollout.multi_turn.tool_config_path" and "no_such_module_here" in message
        for key, message in raised.value.problems
    ), raised.value.problems


@pytest.mark.parametrize(
    "words, key",
    [
        (["actor_rollout_ref.rollout.weight_sync.backend=gloo"], "actor_rollout_ref.rollout.weight_sync.backend"),
        (
            ["actor_rollout_ref.rollout.multi_turn.format=question_mark"],
            "actor_rollout_ref.rollout.multi_turn.tool_config_path",
        ),
        (["skip.reward.enable=true", "skip.reward.steps=[1]"], "skip.reward.enable"),
    ],
)
def test_combinations_the_service_does_not_run_name_the_key(words, key):
    with pytest.raises(ConfigError) as raised:
        load_config("grpo_tiny", ["actor_rollout_ref.rollout.mode=async", *words])
    assert key in [k for k, _ in raised.value.problems]
