"""verl's V1 trainer modes on a real local Ray and Prefect: ``colocate_async`` (partial rollout: requests
aborted while the actor trains resume with the new weights) and ``separate_async`` (parameter_sync_step
mini-batch updates per weight push) on the replay buffer; a user's own mode registered from a file; and
the config errors that keep the modes' settings consistent."""

from __future__ import annotations

import asyncio
import json

import pytest

from ppoflow.configs import ConfigError, load_config
from ppoflow.flows.tracking import read_metrics
from ppoflow.workers.service.requests import RequestSampling
from tests.flow_runs import task_runs_by_name


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


@pytest.mark.parametrize("partial_rollout", [True, False])
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


def run_overrides(tiny_model, tmp_path, *words) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        "data.val_files=null",
        "data.synthetic.train_rows=64",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.num_replicas=2",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
        *words,
    ]


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
        assert len(ray_local.get(replica.generate.remote("fresh", [4, 5, 6], fresh)).token_ids) == 8
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


MODE_FILE = '''
import json
from ppoflow.flows.modes import SyncTrainer, register_trainer

@register_trainer("recording_sync")
class RecordingSync(SyncTrainer):
    """sync, writing down every hook it sees."""

    def note(self, hook, step=None):
        with open({log!r}, "a") as log:
            log.write(json.dumps([hook, step]) + "\\n")

    def on_init_end(self): self.note("on_init_end")
    def on_train_begin(self, steps): self.note("on_train_begin")
    def on_step_begin(self, step): self.note("on_step_begin", step.step)
    def on_sample_begin(self, step):
        self.note("on_sample_begin", step.step)
        super().on_sample_begin(step)
    def on_sample_end(self, step): self.note("on_sample_end", step.step)
    def on_step_end(self, step):
        self.note("on_step_end", step.step)
        super().on_step_end(step)
    def on_validate_begin(self, step): self.note("on_validate_begin", step)
    def on_validate_end(self, step): self.note("on_validate_end", step)
    def on_train_end(self): self.note("on_train_end")
'''


def test_a_users_own_mode_is_named_in_the_config(prefect_api, ray_local, tiny_model, tmp_path):
    from ppoflow.configs import load_config
    from ppoflow.flows.train import run_ppo_train

    log = tmp_path / "hooks.jsonl"
    (tmp_path / "my_modes.py").write_text(MODE_FILE.format(log=str(log)))
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet",
        "data.synthetic.train_rows=32",
        "data.synthetic.val_rows=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
        f"trainer.v1.trainer_module={tmp_path}/my_modes.py",
        "trainer.v1.trainer_mode=recording_sync",
    ]
    # as `ppoflow train` calls it: the typed fields from the config, where a user's mode is not one
    state = run_ppo_train("grpo_tiny", overrides, load_config("grpo_tiny", overrides), return_state=True)
    assert state.is_completed(), state
    hooks = [tuple(json.loads(line)) for line in log.read_text().splitlines()]

    def per_step(number: int) -> list[tuple]:
        return [(hook, number) for hook in ("on_step_begin", "on_sample_begin", "on_sample_end", "on_step_end")]

    assert hooks == [
        ("on_init_end", None),
        ("on_train_begin", None),
        *per_step(1),
        *per_step(2),
        ("on_validate_begin", 2),
        ("on_validate_end", 2),
        ("on_train_end", None),
    ]


def test_a_mode_or_sampler_file_that_does_not_import_is_a_config_error(tmp_path):
    from ppoflow.flows.train import check_mode

    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    for path, needle in ((tmp_path / "broken.py", "RuntimeError: no"), (tmp_path / "missing.py", "no such file")):
        cfg = load_config("grpo_tiny", [f"trainer.v1.trainer_module={path}"])
        with pytest.raises(ConfigError) as raised:
            check_mode(cfg)
        assert raised.value.problems[0][0] == "trainer.v1.trainer_module" and needle in raised.value.problems[0][1]
    cfg = load_config(
        "grpo_tiny",
        [
            f"trainer.v1.sampler.custom_sampler.path={tmp_path}/missing.py",
            "trainer.v1.sampler.custom_sampler.name=Sampler",
        ],
    )
    with pytest.raises(ConfigError) as raised:
        check_mode(cfg)
    assert raised.value.problems[0][0] == "trainer.v1.sampler.custom_sampler"
    assert "no such file" in raised.value.problems[0][1]


LEDGER_MODE = '''
import json
from ppoflow.flows.async_modes import ColocateAsyncTrainer
from ppoflow.flows.modes import register_trainer
from ppoflow.storage.batch import non_tensor_column

@register_trainer({name!r})
class LedgerAsync(ColocateAsyncTrainer):
    """colocate_async, writing down the prompts each step trains on and what the buffer holds at the end."""

    def note(self, entry):
        with open({log!r}, "a") as log:
            log.write(json.dumps(entry) + "\\n")

    def sample(self, step):
        super().sample(step)
        self.note({{"step": step.step, "trained": sorted(set(non_tensor_column(step.batch, "uid")))}})

    def on_train_end(self):
        self.note({{"left": sorted(self.prompts), "fed": self.state.fed}})
'''


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


def test_an_async_run_ends_without_failure_lines(prefect_server, tiny_model, tmp_path):
    """``ppoflow train`` in separate_async, its own Ray printing its workers' logs: generation runs ahead,
    so groups are in flight when training ends; they are ended before the actors are killed, and the
    run's output has no failed task, no dead actor, no unhandled error."""
    import subprocess
    import sys

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
        [sys.executable, "-m", "ppoflow.flows.cli", "train", *overrides], capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [row["step"] for row in read_metrics(str(tmp_path / "run"))] == [1, 2]
    for needle in ("failed", "actor is dead", "Unhandled error", "Traceback"):
        assert needle.lower() not in output.lower(), output


PASSES_THE_PREFLIGHT_ONLY = """
import time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls = Path(__file__).with_suffix(".calls")
    calls.write_text(calls.read_text() + "." if calls.exists() else ".")
    if len(calls.read_text()) > 1:  # the preflight's call passes; the rollout's do not
        {then}
    return 0.0
"""
"""A custom scorer that passes the preflight's call, then does ``then`` on every call."""


@pytest.mark.slow  # ~40 s of a CLI run each, these three
def test_an_async_run_whose_scorer_fails_stops_at_once_naming_it(prefect_server, tiny_model, tmp_path):
    """A custom scorer failing in the rollout service (async scoring) fails the run with one line and exit 1,
    instead of failing group after group that the buffer would refill for ever."""
    import subprocess
    import sys

    failing = PASSES_THE_PREFLIGHT_ONLY.format(then='raise RuntimeError("the judge is down")')
    (tmp_path / "scorer.py").write_text(failing)
    words = ["trainer.v1.trainer_mode=colocate_async", f"custom_reward_function.path={tmp_path}/scorer.py"]
    done = subprocess.run(
        [sys.executable, "-m", "ppoflow.flows.cli", "train", *run_overrides(tiny_model, tmp_path, *words)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ppoflow: the run failed: "), done.stderr[-3000:]
    assert f"the custom scorer '{tmp_path}/scorer.py:compute_score' raised RuntimeError: the judge is down" in last


@pytest.mark.slow
def test_a_scorer_past_its_deadline_in_the_rollout_service_fails_generate_once(
    prefect_api, ray_local, tiny_model, tmp_path
):
    """A sync run whose async rollout scores as it samples: a scorer past custom_reward_function.timeout_s
    fails the generate task run once (never retried: run_count 1) and the run with ScorerTimedOut."""
    from ppoflow.algorithms.scoring import ScorerTimedOut
    from ppoflow.flows.train import ppo_train
    from tests.flow_runs import task_runs_by_name

    (tmp_path / "scorer.py").write_text(PASSES_THE_PREFLIGHT_ONLY.format(then="time.sleep(10**9)"))
    words = [
        f"custom_reward_function.path={tmp_path}/scorer.py",
        "custom_reward_function.timeout_s=1",
        "trainer.total_training_steps=1",
    ]
    overrides = run_overrides(tiny_model, tmp_path, *words)
    state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
    assert state.is_failed()
    with pytest.raises(ScorerTimedOut, match="custom_reward_function.timeout_s=1 s"):
        state.result()
    generate = task_runs_by_name(state.state_details.flow_run_id, ["generate[step=1]"])["generate[step=1]"]
    assert generate.state.is_failed() and generate.run_count == 1


BROKEN_LOOP = """
from ppoflow.workers.service.agent_loop import AgentLoop

class Broken(AgentLoop):
    async def run(self, sampling, **row):
        raise RuntimeError("the loop is broken")
"""


@pytest.mark.slow
def test_an_async_run_whose_every_generation_fails_stops(prefect_server, tiny_model, tmp_path):
    """An agent loop that raises on every prompt: the buffer evicts and refills each failed group, until two
    batches' worth have failed in a row; then the run stops with one line and exit 1, naming the last error."""
    import os
    import subprocess
    import sys

    (tmp_path / "broken_loops.py").write_text(BROKEN_LOOP)
    (tmp_path / "loops.yaml").write_text("- name: broken_agent\n  _target_: broken_loops.Broken\n")
    words = [
        "trainer.v1.trainer_mode=colocate_async",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path}/loops.yaml",
        "actor_rollout_ref.rollout.agent.default_agent_loop=broken_agent",
    ]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-m", "ppoflow.flows.cli", "train", *run_overrides(tiny_model, tmp_path, *words)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "ppoflow: the run failed: the last 8 prompt groups generated all failed, the last with "
        "RuntimeError('the loop is broken')"
    ), done.stderr[-3000:]


NEEDY_MODE = '''
from ppoflow.configs.modes import ModeNeeds
from ppoflow.flows.modes import SyncTrainer, register_trainer

@register_trainer({name!r})
class Needy(SyncTrainer):
    """sync, generating through the rollout service."""

    needs = ModeNeeds(summary="sync through the rollout service", rollout_service=True)
'''


def a_mode_file(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(NEEDY_MODE.format(name=name))
    return str(path)


def test_a_users_mode_is_in_the_forms_choices_and_fills_its_mode_field(tmp_path):
    """``ppoflow serve --config`` imports the config's trainer_module before building the deployment: the
    form's dropdown (the deployment's parameter schema) lists the user's mode, and the preset's mode fills it."""
    import yaml

    from ppoflow.configs import CONFIG_DIR
    from ppoflow.flows.deploy import deployments

    preset, config = tmp_path / "needy.yaml", yaml.safe_load((CONFIG_DIR / "grpo_tiny.yaml").read_text())
    config["trainer"] = {
        **config["trainer"],
        "mode": "needy_form",
        "v1": {"trainer_module": a_mode_file(tmp_path, "needy_form")},
    }
    config["actor_rollout_ref"]["rollout"] = {**config["actor_rollout_ref"].get("rollout", {}), "mode": "async"}
    preset.write_text(yaml.safe_dump(config))
    ppo_train = deployments(str(tmp_path / "no-golden"), preset=str(preset))[0]
    mode = ppo_train._parameter_openapi_schema.model_dump()["properties"]["mode"]
    assert mode["anyOf"][0]["enum"][:4] == ["sync", "one_step_off", "colocate_async", "separate_async"]
    assert "needy_form" in mode["anyOf"][0]["enum"]
    assert ppo_train.parameters["mode"] == "needy_form"


def test_a_users_mode_that_needs_the_rollout_service_is_refused_without_it(tmp_path, capsys):
    from tests.test_preflight import assert_user_error, run_cli

    module = a_mode_file(tmp_path, "needy_cli")
    words = [f"trainer.v1.trainer_module={module}", "trainer.mode=needy_cli", f"trainer.default_local_dir={tmp_path}"]
    code, stderr = run_cli(capsys, "train", *words)
    assert_user_error(code, stderr, "trainer.mode: needy_cli generates with the rollout service", "mode=async")
    with pytest.raises(ConfigError) as raised:  # now that the mode is registered, the config itself refuses it
        load_config("grpo_tiny", words)
    assert [key for key, _ in raised.value.problems] == ["trainer.mode"]


def test_an_unknown_mode_is_refused_naming_the_registered_ones_the_users_too(tmp_path):
    from ppoflow.flows.train import check_mode

    module = a_mode_file(tmp_path, "needy_named")
    cfg = load_config("grpo_tiny", [f"trainer.v1.trainer_module={module}", "trainer.mode=no_such_mode"])
    with pytest.raises(ConfigError) as raised:
        check_mode(cfg)
    ((key, message),) = raised.value.problems
    assert key == "trainer.mode" and "sync, one_step_off, colocate_async, separate_async" in message
    assert "needy_named" in message
