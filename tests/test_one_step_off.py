"""One-step-off: the next batch is generated while this one trains; weight versions prove the lag."""

from __future__ import annotations

import pytest

from ppoflow.flows.tracking import read_metrics
from ppoflow.flows.train import ppo_train
from tests.flow_runs import generate_states, rollout_skip


@pytest.fixture
def overrides(tiny_overrides):
    return [word for word in tiny_overrides if not word.startswith(("trainer.", "data.val_files"))] + [
        "data.val_files=null",
        "trainer.logger=[]",
        "trainer.test_freq=-1",
    ]


def run(overrides, tmp_path, name, steps, extra=()):
    state = ppo_train(
        config="grpo_tiny",
        overrides=overrides
        + [f"trainer.default_local_dir={tmp_path}/{name}", f"trainer.total_training_steps={steps}", *extra],
        return_state=True,
    )
    assert state.is_completed(), state
    return read_metrics(f"{tmp_path}/{name}"), state.state_details.flow_run_id


def staleness(rows):
    return [
        (row["training/off_policy/trajectory_staleness/mean"], row["training/off_policy/trajectory_staleness/max"])
        for row in rows
    ]


EXACT = "actor_rollout_ref.rollout.dtype=float32"
"""The rollout in the actor's dtype: the same weights give the same probabilities, so a lag shows as any difference."""


def test_lag_is_zero_in_sync_and_exactly_one_step_off(prefect_api, ray_local, overrides, tmp_path):
    # sync, with the collective (gloo) weight sync: after every sync the rollout samples with the actor's weights
    sync, _ = run(
        overrides,
        tmp_path,
        "sync",
        4,
        [
            "actor_rollout_ref.rollout.weight_sync.backend=gloo",
            "actor_rollout_ref.rollout.weight_sync.bucket_mb=1",
            EXACT,
        ],
    )
    assert staleness(sync) == [(0, 0)] * 4
    assert all(row["training/rollout_probs_diff_max"] < 1e-5 for row in sync)

    # one_step_off, with verl's decoupled correction of the lag (IS weights and rejection sampling)
    off, flow_run = run(
        overrides,
        tmp_path,
        "off",
        4,
        [
            "trainer.mode=one_step_off",
            EXACT,
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ],
    )
    assert staleness(off) == [(0, 0), (1, 1), (1, 1), (1, 1)]
    assert off[0]["training/rollout_probs_diff_max"] < 1e-5 < off[1]["training/rollout_probs_diff_max"]
    for row in off:
        for name in (
            "timing_s/gen",
            "timing_s/generate_async",
            "timing_s/sync_rollout_weights",
            "timing_s/update_weights",
            "perf/generate_overlap_ratio",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_rs_masked_fraction",
        ):
            assert name in row, name
    assert generate_states(flow_run, 4) == ["Completed"] * 4  # the last step starts no generation


@pytest.mark.slow
def test_a_replayed_step_starts_no_generation(prefect_api, ray_local, overrides, tmp_path):
    dump = tmp_path / "dump"
    skip = [f"skip.{key}={value}" for key, value in rollout_skip(dump, [2]).items()]
    run(overrides, tmp_path, "fill", 2, skip)  # caches step 2 (sync)
    rows, flow_run = run(overrides, tmp_path, "off", 3, ["trainer.mode=one_step_off", *skip])
    assert [row.get("skip/rollout/hit") for row in rows] == [None, 1, None]
    assert generate_states(flow_run, 3) == ["Completed", "Cached", "Completed"]
    assert staleness([rows[0], rows[2]]) == [(0, 0), (1, 1)]  # one step deep around the replayed step


@pytest.mark.slow
def test_bypass_mode_uses_the_rollout_log_probs(prefect_api, ray_local, overrides, tmp_path):
    rows, _ = run(
        overrides, tmp_path, "bypass", 2, ["trainer.mode=one_step_off", "algorithm.rollout_correction.bypass_mode=true"]
    )
    assert "timing_s/old_log_prob" not in rows[-1] and "rollout_corr/rollout_is_mean" not in rows[-1]
    assert rows[-1]["actor/ppo_kl"] != 0  # the ratio is against the (one update old) sampling policy
