"""DAPO: dynamic sampling (``algorithm.filter_groups``) and the overlong penalty, by hand values, then in tiny
runs: sync (metrics, a bit-identical replay), one_step_off and colocate_async."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ppoflow.algorithms.dynamic_sampling import kept_groups, overlong_penalty
from ppoflow.configs.loader import load_config
from ppoflow.configs.problems import ConfigError
from ppoflow.flows.step import filter_metric
from ppoflow.storage.batch import with_non_tensor_columns
from ppoflow.tasks.reward import shape_overlong
from tests.async_modes_helpers import run_overrides
from tests.conftest import small_run
from tests.flow_runs import UPDATE_METRICS, rollout_skip, train

FILTER = [
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=score",
    "algorithm.filter_groups.max_num_gen_batches=0",
]


def test_groups_whose_values_all_agree_are_dropped():
    uids = ["a", "a", "a", "b", "b", "b", "c", "d", "d"]
    values = [1.0, 1.0, 1.0, 0.0, 0.5, 0.0, 0.3, 0.0, 0.0]
    # a: all 1 (all correct), d: all 0 (all wrong) go; b varies; c has one response, which verl keeps
    assert kept_groups(uids, values) == ["b", "c"]


def test_overlong_penalty_hand_values():
    # budget 10, buffer 4: free up to 6 tokens, then -factor * (L - 6) / 4
    lengths = torch.tensor([3, 6, 7, 8, 10])
    expected = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5])
    assert torch.allclose(overlong_penalty(lengths, 10, 4, 0.5), expected, atol=0)


def test_shape_overlong_adds_the_penalty_on_the_last_token():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    scores = torch.tensor([[0, 0, 0, 1.0], [0, 0.5, 0, 0], [0, 0, 0.0, 0]])
    batch = TensorDict({"response_mask": mask, "token_level_scores": scores}, batch_size=[3])
    overlong = load_config("grpo_tiny").reward_model.reward_kwargs.overlong_buffer_cfg.model_copy(
        update={"enable": True, "len": 2, "penalty_factor": 1.0, "log": True}
    )
    result = shape_overlong(batch, overlong, max_resp_len=4)
    # lengths 4, 2, 3 against a free length of 2: penalties -1, 0, -0.5, each on the row's last token
    expected = torch.tensor([[0, 0, 0, 0.0], [0, 0.5, 0, 0], [0, 0, -0.5, 0]])
    assert torch.equal(result.fields["token_level_scores"], expected)
    assert result.fields["overlong_reward"].tolist() == [-1.0, 0.0, -0.5]
    assert result.metrics == {"reward/overlong_reward/mean": -0.5, "reward/overlong/mean": pytest.approx(2 / 3)}


def test_the_filter_metric_reads_scores_or_the_scorers_acc():
    scores = torch.tensor([[0, 1.0], [0.25, 0.25]])
    batch = with_non_tensor_columns(
        TensorDict({"token_level_scores": scores}, batch_size=[2]), {"reward_extras": [{"acc": 1}, {"acc": 0}]}
    )
    assert filter_metric(batch, "score") == filter_metric(batch, "seq_reward") == [1.0, 0.5]
    assert filter_metric(batch, "acc") == [1.0, 0.0]
    with_non_tensor_columns(batch, {"reward_extras": [{"acc": 1}, {}]})
    with pytest.raises(ValueError, match="metric=acc"):
        filter_metric(batch, "acc")


@pytest.mark.parametrize(
    ("words", "key"),
    [
        (["data.gen_batch_size=32"], "data.gen_batch_size"),
        (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.metric"),
        (["reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"], "overlong_buffer_cfg.len"),
        (
            [*FILTER, "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
            "algorithm.filter_groups.metric",
        ),
    ],
)
def test_dapo_settings_that_cannot_work_are_refused_by_name(words, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("grpo_tiny", ["actor_rollout_ref.model.path=x", "data.train_files=x", *words])


def test_the_dapo_preset_loads():
    cfg = load_config("dapo_tiny")
    assert cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size > cfg.data.train_batch_size


@pytest.fixture
def overrides(tiny_model, tmp_path):
    return [*small_run(tiny_model, tmp_path / "data"), "trainer.test_freq=-1", *FILTER]


def test_a_sync_run_filters_groups(prefect_api, ray_local, overrides, tmp_path):
    # the random tiny model copies nothing at first: many groups score 0 on every response
    rows, _ = train(overrides, tmp_path / "first", 3, {})
    check_filtered(rows)


def check_filtered(rows: list[dict]) -> None:
    for row in rows:
        generated = row["train/num_gen_batches"] * 4  # gen_batch_size = train_batch_size = 4 prompts
        kept = generated - row["training/filter_groups/evicted_samples"]
        assert kept >= 4 and kept - 4 == row["training/filter_groups/discarded_surplus_samples"]
        assert row["training/filter_groups/kept_group_ratio"] == pytest.approx(kept / generated)
        assert row["reward/useful_group_ratio"] == 1.0  # every trained group's scores differ
    assert sum(row["training/filter_groups/evicted_samples"] for row in rows) > 0
    assert any(row["train/num_gen_batches"] > 1 for row in rows)


@pytest.mark.slow  # two runs; the sync filtering above runs by default, a cached replay in test_cache_flow.py
def test_a_sync_run_with_filtered_groups_replays_bit_identically(prefect_api, ray_local, overrides, tmp_path):
    dump, steps = tmp_path / "dump", list(range(1, 11))  # feed indexes: refills go past the 3 steps
    rows, _ = train(overrides, tmp_path / "first", 3, rollout_skip(dump, steps))
    check_filtered(rows)
    replayed, _ = train(overrides, tmp_path / "replay", 3, rollout_skip(dump, steps))
    assert all(row["skip/rollout/hit"] == 1 for row in replayed)
    for before, after in zip(rows, replayed, strict=True):
        assert before["train/num_gen_batches"] == after["train/num_gen_batches"]
        for name in UPDATE_METRICS:
            assert before[name] == after[name], (name, before["step"])  # bit for bit


@pytest.mark.slow  # a run (~6 s); filtering in a sync run runs by default
def test_the_limit_on_generation_batches_fails_the_step_naming_it(prefect_api, ray_local, overrides, tmp_path):
    from ppoflow.flows.train import ppo_train

    words = [*overrides, "algorithm.filter_groups.max_num_gen_batches=1", f"trainer.default_local_dir={tmp_path}/r"]
    words += ["actor_rollout_ref.rollout.temperature=0.01"]  # near-greedy: every group's responses agree
    state = ppo_train(config="grpo_tiny", overrides=words, return_state=True)
    assert state.is_failed()
    assert "max_num_gen_batches=1" in str(state.result(raise_on_failure=False))


def test_acc_from_a_scorer_without_one_is_refused_before_the_run(overrides, tmp_path):
    """The preflight scores the first row: a scorer that reports no ``acc`` (the copy task's) is bad input naming
    the key, before Prefect or Ray start; ``score`` passes."""
    from ppoflow.flows.preflight import preflight

    words = [*overrides, f"trainer.default_local_dir={tmp_path}/r"]
    preflight(load_config("grpo_tiny", words))
    with pytest.raises(ConfigError) as raised:
        preflight(load_config("grpo_tiny", [*words, "algorithm.filter_groups.metric=acc"]))
    ((key, message),) = raised.value.problems
    assert key == "algorithm.filter_groups.metric"
    assert "the scorer reports no `acc` for the first row of data.train_files (it reports exact)" in message


@pytest.mark.slow  # a run (~8 s); sync filtering runs by default
def test_one_step_off_filters_groups(prefect_api, ray_local, overrides, tmp_path):
    rows, _ = train([*overrides, "trainer.mode=one_step_off", "data.gen_batch_size=8"], tmp_path / "off", 2, {})
    assert all(row["train/num_gen_batches"] >= 1 for row in rows)
    assert all(row["training/off_policy/trajectory_staleness/max"] == 1 for row in rows[1:])


@pytest.mark.slow  # an async run (~12 s); sync and one_step_off filtering run by default
def test_colocate_async_refills_filtered_groups(prefect_api, ray_local, tiny_model, tmp_path):
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    words = run_overrides(tiny_model, tmp_path, "trainer.mode=colocate_async", "algorithm.adv_estimator=grpo", *FILTER)
    state = ppo_train(
        config="grpo_tiny",
        overrides=[*words, "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"],
        return_state=True,
    )
    assert state.is_completed(), state
    rows = read_metrics(str(tmp_path / "run"))
    assert len(rows) == 3
    assert sum(row["training/filter_groups/evicted_samples"] for row in rows) > 0
    assert all(row["training/filter_groups/kept_group_ratio"] <= 1 for row in rows)


@pytest.mark.slow  # ~40 s: two separate_async runs
def test_separate_async_with_cached_samples_filters_and_replays_bit_for_bit(
    prefect_api, ray_local, tiny_model, tmp_path
):
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    words = [
        "trainer.v1.trainer_mode=separate_async",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "skip.async_rollout.enable=true",
        f"skip.async_rollout.dump_dir={tmp_path}/samples",
        f"skip.async_rollout.steps={list(range(1, 201))}",  # feed indexes: refills go past the 12 of 3 steps
        *FILTER,
    ]
    runs = []
    for name in ("recorded", "replayed"):
        overrides = [*run_overrides(tiny_model, tmp_path, *words), f"trainer.default_local_dir={tmp_path}/{name}"]
        state = ppo_train(config="grpo_tiny", overrides=overrides, return_state=True)
        assert state.is_completed(), state
        runs.append(read_metrics(str(tmp_path / name)))
    recorded, replayed = runs
    assert sum(row["training/filter_groups/evicted_samples"] for row in recorded) > 0
    assert [row["skip/async_rollout/hit"] for row in replayed] == [1.0] * 3
    for name in ("training/filter_groups/evicted_samples", *UPDATE_METRICS):
        assert [row[name] for row in replayed] == [row[name] for row in recorded], name
