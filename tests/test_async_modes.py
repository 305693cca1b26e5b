"""verl's V1 trainer modes on a real local Ray and Prefect: ``colocate_async`` (partial rollout: requests
aborted while the actor trains resume with the new weights) and ``separate_async`` (parameter_sync_step
mini-batch updates per weight push) on the replay buffer, resumed and replayed; and the config errors that
keep the modes' settings consistent. Failing runs: tests/test_async_modes_failures.py; a user's own modes:
tests/test_async_modes_user_modes.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.tracking import read_metrics
from ppoflow.workers.rollout.requests import RequestSampling
from tests.async_modes_helpers import LEDGER_MODE, run_overrides
from tests.flow_runs import task_runs_by_name
from tests.preflight_helpers import DEMO_TRAIN


def problems(words: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as raised:
        load_config("grpo_tiny", words)
    return raised.value.problems


def test_trainer_mode_and_verls_key_are_one_setting():
    assert load_config("grpo_tiny", ["trainer.v1.trainer_mode=one_step_off"]).trainer.mode == "one_step_off"
    assert load_config("grpo_tiny", ["trainer.mode=one_step_off"]).trainer.v1.trainer_mode == "one_step_off"
    assert load_config("grpo_tiny").trainer.mode == "sync"
    assert problems(["trainer.mode=sync", "trainer.v1.trainer_mode=one_step_off"]) == [
        (
            "trainer.v1.trainer_mode",
            "'one_step_off' disagrees with trainer.mode='sync': they are one setting; set one of them",
        )
    ]


@pytest.mark.parametrize(
    "words, key, needle",
    [
        (["trainer.mode=colocate_async"], "trainer.mode", "set actor_rollout_ref.rollout.mode=async"),
        (
            ["trainer.mode=separate_async", "actor_rollout_ref.rollout.mode=async"],
            "trainer.v1.separate_async.parameter_sync_step",
            "data.train_batch_size (16) must be 64: set parameter_sync_step=1 or ppo_mini_batch_size=4",
        ),
        (
            [
                "trainer.mode=colocate_async",
                "actor_rollout_ref.rollout.mode=async",
                "skip.rollout.enable=true",
                "skip.rollout.steps=[1]",
            ],
            "skip.rollout.enable",
            "skip.async_rollout",
        ),
        (["trainer.v1.sampler.max_off_policy_strategy=newest"], "trainer.v1.sampler.max_off_policy_strategy", "drop"),
        (["trainer.v1.sampler.max_off_policy_threshold=0"], "trainer.v1.sampler.max_off_policy_threshold", "1"),
    ],
)
def test_async_mode_settings_are_checked_before_anything_starts(words, key, needle):
    found = problems(words)
    assert any(k == key and needle in message for k, message in found), found


@pytest.mark.parametrize(
    "partial_rollout",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # ~5 s each; the partial rollout runs by default
)
def test_an_aborted_request_resumes_with_the_new_weights(ray_local, tiny_model, partial_rollout):
    """A replica put to sleep mid-request returns the partial output; the load balancer resumes it once the
    replica wakes with new weights, so the turn's tokens span versions 0 and 3 (partial rollout) - or,
    without partial rollout, starts it over, so every token of it comes from version 3."""
    from ppoflow.workers.models import load_causal_lm
    from ppoflow.workers.service.replicas import LoadBalancer, RolloutReplica
    from ppoflow.workers.weight_sync import WeightSender

    cfg = load_config(
        "grpo_tiny", [f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.mode=async"]
    )
    replica = ray_local.remote(RolloutReplica).options(num_cpus=0).remote(cfg)
    update, _ = WeightSender(cfg.actor_rollout_ref.rollout.weight_sync).prepare(
        load_causal_lm(cfg.actor_rollout_ref.model).state_dict(), 3
    )
    sampling = RequestSampling(
        temperature=1.0, top_p=1.0, top_k=-1, greedy=False, max_new_tokens=56, seed=5, ignore_eos=True
    )

    async def interrupted() -> tuple:
        balancer = LoadBalancer([replica], partial_rollout=partial_rollout)
        requests = [asyncio.ensure_future(balancer.generate(f"s{i}", [4, 5, 6], sampling)) for i in range(8)]
        while ray_local.get(replica.stats.remote())["tokens_generated"] < 8:  # mid-generation
            await asyncio.sleep(0.001)
        aborted = await replica.sleep.remote()
        await replica.apply_weights.remote(update)
        await replica.wake.remote()
        return aborted, await asyncio.gather(*requests)

    aborted, outputs = asyncio.run(interrupted())
    ray_local.kill(replica)
    assert aborted > 0
    assert all(len(output.token_ids) == len(output.log_probs) == 56 for output in outputs)
    assert all(output.finish_reason == "length" for output in outputs)
    spans = {output.weight_versions for output in outputs}
    if partial_rollout:
        assert (0, 3) in spans and spans <= {(0, 3), (3, 3), (0, 0)}
    else:
        assert (3, 3) in spans and spans <= {(3, 3), (0, 0)}


@pytest.mark.slow  # ~6 s; an async run trains by default below
def test_cancelled_groups_end_with_their_replica_requests(ray_local, tiny_model):
    """What an async run does with the groups still in flight when it ends: a group whose requests wait on
    a sleeping replica is cancelled, ends, and takes its requests with it - the replica, woken, has
    nothing left to generate (a request left waiting would fail when the run kills the replica)."""
    import torch
    from tensordict import TensorDict

    from ppoflow.workers.rollout.sampling import SamplingParams
    from ppoflow.workers.service.agent_worker import AgentLoopWorker
    from ppoflow.workers.service.replicas import RolloutReplica
    from ppoflow.workers.service.rollout_service import RolloutService

    cfg = load_config(
        "grpo_tiny", [f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.mode=async"]
    )
    replica = ray_local.remote(RolloutReplica).options(num_cpus=0).remote(cfg)
    agent = ray_local.remote(AgentLoopWorker).options(num_cpus=0).remote(cfg, [replica])
    service = RolloutService([replica], [agent], pad_token_id=0)
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, do_sample=True, max_new_tokens=8, seed=0)
    prompt = TensorDict(
        {"prompts": torch.tensor([[4, 5, 6]]), "prompt_mask": torch.ones(1, 3, dtype=torch.bool)}, batch_size=[1]
    )
    try:
        ray_local.get(replica.sleep.remote())
        group = service.submit_group(prompt, position=0, step=1, sampling=sampling)
        assert not ray_local.wait([group], timeout=1)[0]  # waiting for the replica to wake
        service.cancel([group], timeout_s=30)
        assert ray_local.wait([group], timeout=0)[0]
        with pytest.raises(ray_local.exceptions.TaskCancelledError):
            ray_local.get(group)
        ray_local.get(replica.wake.remote())
        fresh = RequestSampling(
            temperature=1.0, top_p=1.0, top_k=-1, greedy=False, max_new_tokens=8, seed=5, ignore_eos=True
        )
        assert len(ray_local.get(replica.generate_tokens.remote("fresh", [4, 5, 6], fresh)).token_ids) == 8
        stats = ray_local.get(replica.stats.remote())  # a woken request would have generated beside it
        assert stats["tokens_generated"] == 8 and stats["running"] == stats["waiting"] == 0, stats
    finally:
        ray_local.kill(agent)
        ray_local.kill(replica)


@pytest.mark.parametrize(
    "words",
    [
        [
            "trainer.v1.trainer_mode=colocate_async",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
        pytest.param(
            [
                "trainer.v1.trainer_mode=separate_async",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                "trainer.v1.separate_async.parameter_sync_step=2",
                "trainer.v1.sampler.max_off_policy_threshold=2",
            ],
            marks=pytest.mark.slow,
        ),  # the default run trains separate_async in the replay test below
    ],
)
def test_an_async_run_trains_on_the_replay_buffer(prefect_api, ray_local, tiny_model, tmp_path, words):
    """Three steps through Prefect: each step's batch is sampled from the buffer (the ``sample`` stage), its
    staleness is within the threshold, and the rollout keeps generating ahead of the trainer."""
    from ppoflow.flows.train import ppo_train

    state = ppo_train(config="grpo_tiny", overrides=run_overrides(tiny_model, tmp_path, *words), return_state=True)
    assert state.is_completed(), state
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["step"] for row in rows] == [1, 2, 3]
    threshold = 2 if "separate_async" in words[0] else 8
    for row in rows:
        assert row["timing_s/gen"] > 0 and row["response_length/mean"] > 0
        assert 0 <= row["training/off_policy/trajectory_staleness/min"]
        assert row["training/off_policy/trajectory_staleness_worst/max"] <= threshold
        assert row["training/off_policy/trajectory_spans/min"] >= 1
    if "colocate_async" in words[0]:
        assert all("rollout/aborted_requests" in row for row in rows)
        # the Task inputs tab: the batch came from sample[step=N]
        runs = task_runs_by_name(state.state_details.flow_run_id, ["advantage[step=2]", "sample[step=2]"])
        assert [link.id for link in runs["advantage[step=2]"].task_inputs["batch"]] == [runs["sample[step=2]"].id]
    else:  # two rounds a step, both with the step's first weights as π_old: a forward pass, not the shortcut
        assert all("training/old_log_prob_skipped" not in row and row["timing_s/old_log_prob"] > 0 for row in rows)


@pytest.mark.slow  # ~35 s; the slow suite also kills async runs at random points (tests/test_kill_sweep.py)
def test_a_resumed_async_run_trains_every_prompt_once(prefect_api, ray_local, tiny_model, tmp_path):
    """Two steps with a checkpoint, then a resumed run to step four: the prompts in flight at the checkpoint
    are dispatched again, none is trained twice, and every prompt fed is trained or still in the buffer."""
    from ppoflow.flows.train import ppo_train

    log = tmp_path / "ledger.jsonl"
    (tmp_path / "ledger.py").write_text(LEDGER_MODE.format(log=str(log), name="ledger_async"))
    words = [
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.save_freq=2",
        f"trainer.v1.trainer_module={tmp_path}/ledger.py",
        "trainer.v1.trainer_mode=ledger_async",
    ]
    for steps in (2, 4):
        overrides = run_overrides(tiny_model, tmp_path, *words)
        overrides[overrides.index("trainer.total_training_steps=3")] = f"trainer.total_training_steps={steps}"
        state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
        assert state.is_completed(), state
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    trained = [entry for entry in entries if "trained" in entry]
    assert [entry["step"] for entry in trained] == [1, 2, 3, 4]
    uids = [uid for entry in trained for uid in entry["trained"]]
    assert len(uids) == len(set(uids)) == 16
    first_end, end = [entry for entry in entries if "left" in entry]
    assert set(first_end["left"]).isdisjoint(uids[:8]) and set(end["left"]).isdisjoint(uids)
    fed = {f"sample_0_{index}" for index in range(1, end["fed"] + 1)}
    assert set(uids) | set(end["left"]) == fed
    assert set(first_end["left"]) <= set(uids[8:]) | set(end["left"])  # in flight at the checkpoint: not lost
    rows = read_metrics(str(tmp_path / "run"))
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:  # within the default threshold (8), and the replicas slept while the actor trained
        assert row["training/off_policy/evicted_samples"] == 0 and "rollout/aborted_requests" in row
        assert 0 <= row["training/off_policy/trajectory_staleness/min"]
        assert row["training/off_policy/trajectory_staleness_worst/max"] <= 8


@pytest.mark.slow  # ~40 s of training; a replayed group is checked in tests/test_sample_cache.py
def test_an_async_run_replays_its_cached_samples_bit_for_bit(prefect_api, ray_local, tiny_model, tmp_path):
    """separate_async (two rounds a step) with every sample cached (``skip.async_rollout``): a second run
    replays them all and trains exactly as the first did - each step takes its own prompts in feed order,
    never the first to finish."""
    from ppoflow.flows.train import ppo_train

    words = [
        "trainer.v1.trainer_mode=separate_async",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "skip.async_rollout.enable=true",
        f"skip.async_rollout.dump_dir={tmp_path}/samples",
        "skip.async_rollout.steps=[1,2,3,4,5,6,7,8,9,10,11,12]",
    ]
    runs = []
    for name in ("recorded", "replayed"):
        overrides = [*run_overrides(tiny_model, tmp_path, *words), f"trainer.default_local_dir={tmp_path}/{name}"]
        state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
        assert state.is_completed(), state
        runs.append(read_metrics(str(tmp_path / name)))
    recorded, replayed = runs
    assert [row["skip/async_rollout/hit"] for row in recorded] == [0.0] * 3
    assert [row["skip/async_rollout/hit"] for row in replayed] == [1.0] * 3
    for name in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert [row[name] for row in replayed] == [row[name] for row in recorded], name
    for row in recorded:  # two rounds a step, both with the step's first weights as π_old: a forward pass
        assert "training/old_log_prob_skipped" not in row and row["timing_s/old_log_prob"] > 0
        assert row["training/off_policy/trajectory_staleness/max"] == 0  # no warm-up: each step its own prompts


@pytest.mark.slow  # a whole async run read back from the server (~35 s)
def test_an_async_run_ends_without_failure_lines(prefect_server, tiny_model, tmp_path):
    """``ppoflow train`` in separate_async, its own Ray printing its workers' logs: generation runs ahead,
    so groups are in flight when training ends; they are ended before the actors are killed, and the
    run's output has no failed task, no dead actor, no unhandled error."""
    import subprocess

    words = [
        "trainer.v1.trainer_mode=separate_async",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "trainer.v1.separate_async.num_warmup_batches=8",
        "trainer.v1.sampler.max_off_policy_threshold=20",
    ]
    overrides = run_overrides(tiny_model, tmp_path, *words)
    overrides[overrides.index("trainer.total_training_steps=3")] = "trainer.total_training_steps=2"
    done = subprocess.run(
        [*DEMO_TRAIN, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [row["step"] for row in read_metrics(str(tmp_path / "run"))] == [1, 2]
    for needle in ("failed", "actor is dead", "Unhandled error", "Traceback"):
        assert needle.lower() not in output.lower(), output
