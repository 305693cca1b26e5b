"""The V1 replay buffer (storage/replay_buffer.py): verl's ReplayBufferAsync cases with hand-made groups and
values (bookkeeping, selection, drop, wait, failures, metrics) and the custom sampler. Save and load:
tests/test_replay_buffer_save.py."""

from __future__ import annotations

import pytest
import torch

from ppoflow.flows.async_modes import load_sampler
from ppoflow.storage.batch import non_tensor_column
from ppoflow.storage.replay_buffer import ReplayBuffer
from tests.replay_buffer_helpers import PAD, make_group, no_poll


def buffer_with(finished: dict[str, int], *, token_of: dict[str, int] | None = None, **kwargs) -> ReplayBuffer:
    """A buffer (pad 99) holding one finished train group per ``{uid: dispatch step}``, in that order."""
    buffer = ReplayBuffer(pad_token_id=PAD, **kwargs)
    for token, (uid, step) in enumerate(finished.items(), start=1):
        buffer.add_prompts([uid], step)
        buffer.finish(uid, make_group((token_of or {}).get(uid, token)))
    return buffer


# -- construction and bookkeeping -----------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0, -1, True, 2.0, "8"])
def test_threshold_must_be_a_positive_int(threshold):
    with pytest.raises(ValueError, match=r"trainer\.v1\.sampler\.max_off_policy_threshold.*" + repr(threshold)):
        ReplayBuffer(pad_token_id=PAD, max_off_policy_threshold=threshold)


@pytest.mark.parametrize("strategy", ["DROP", "keep", None])
def test_strategy_must_be_drop_or_wait(strategy):
    with pytest.raises(ValueError, match=r"trainer\.v1\.sampler\.max_off_policy_strategy.*" + repr(strategy)):
        ReplayBuffer(pad_token_id=PAD, max_off_policy_strategy=strategy)


def test_prompt_lifecycle_keys_and_errors():
    buffer = ReplayBuffer(pad_token_id=PAD)
    buffer.add_prompts(["a", "b", "c"], 3)
    buffer.add_prompts(["v"], 3, partition="val")
    with pytest.raises(ValueError, match="'a'"):
        buffer.add_prompts(["a"], 4)
    with pytest.raises(ValueError, match="'d'"):
        buffer.add_prompts(["d", "d"], 4)
    with pytest.raises(ValueError, match="partition"):
        buffer.add_prompts(["e"], 4, partition="test")
    buffer.mark_running("b")
    buffer.finish("c", make_group(3, n=3))
    buffer.fail("b", "tool server down")
    assert [buffer.status(uid) for uid in "abcv"] == ["pending", "failure", "finished", "pending"]
    assert buffer.in_flight() == {"a": 3} and buffer.in_flight("val") == {"v": 3}
    assert buffer.finished_count() == 1 and buffer.finished_count("val") == 0
    assert buffer.trajectory_keys("c") == ["c_0_0", "c_1_0", "c_2_0"]
    assert buffer.state_dict()["prompts"][1] == {
        "uid": "b",
        "status": "failure",
        "dispatch_step": 3,
        "partition": "train",
        "reason": "tool server down",
    }
    with pytest.raises(ValueError, match="already finished"):
        buffer.finish("c", make_group(3))
    with pytest.raises(ValueError, match="missing \\['max_weight_version'\\]"):
        buffer.finish("a", make_group(1).exclude("max_weight_version"))
    with pytest.raises(KeyError, match="'x'"):
        buffer.status("x")


# -- selection --------------------------------------------------------------------------------------------


def test_sample_takes_the_oldest_groups_first_with_group_index_and_uid():
    buffer = buffer_with({"new": 3, "old": 1, "mid": 2, "old2": 1})
    batch, _ = buffer.sample(3, 3, poll=no_poll)
    assert non_tensor_column(batch, "uid") == ["old", "old", "old2", "old2", "mid", "mid"]
    assert batch["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["group_index"].dtype == torch.int64
    assert batch["responses"][:, 0].tolist() == [20, 21, 40, 41, 30, 31]  # token 2 = old, 4 = old2, 3 = mid
    assert non_tensor_column(batch, "data_source") == ["source2"] * 2 + ["source4"] * 2 + ["source3"] * 2
    assert "rollout_log_probs" in batch.keys()
    assert buffer.finished_count() == 1 and buffer.status("new") == "finished"
    with pytest.raises(KeyError):
        buffer.status("old")


def test_in_order_waits_for_the_oldest_prompts_not_the_first_finished():
    """Replay needs the same groups whatever finishes first: ``in_order`` takes the oldest prompts in feed
    order once they are all finished, where the default takes the oldest of those already finished."""
    buffer = ReplayBuffer(pad_token_id=0)
    buffer.add_prompts(["a", "b", "c", "d"], 1)
    buffer.finish("c", make_group(3))
    buffer.finish("d", make_group(4))
    polls = []

    def poll(interval_s: float) -> None:  # "a" and "b" land later
        polls.append(interval_s)
        buffer.finish(["a", "b"][len(polls) - 1], make_group(len(polls)))

    batch, _ = buffer.sample(1, 2, poll=poll, in_order=True)
    assert non_tensor_column(batch, "uid") == ["a", "a", "b", "b"] and len(polls) == 2
    batch, _ = buffer.sample(1, 2, poll=no_poll)
    assert non_tensor_column(batch, "uid") == ["c", "c", "d", "d"]


def test_groups_of_different_sizes_and_prompt_widths_concatenate():
    buffer = ReplayBuffer(pad_token_id=PAD)
    buffer.add_prompts(["narrow", "wide"], 1)
    buffer.finish("narrow", make_group(1, n=3, width=2))
    buffer.finish("wide", make_group(2, n=2, width=4))
    batch, _ = buffer.sample(1, 2, poll=no_poll)
    assert batch["prompts"].tolist() == [[PAD, PAD, 1, 1]] * 3 + [[2, 2, 2, 2]] * 2
    assert batch["prompt_mask"].tolist() == [[False, False, True, True]] * 3 + [[True] * 4] * 2
    assert batch["group_index"].tolist() == [0, 0, 0, 1, 1]
    assert non_tensor_column(batch, "ground_truth") == [{"answer": 1}] * 3 + [{"answer": 2}] * 2


# -- drop ---------------------------------------------------------------------------------------------------


def test_drop_evicts_past_the_threshold_keeps_the_boundary_and_refills_exactly_k():
    refills = []
    buffer = buffer_with(
        {"span6": 0, "span4": 2, "span2": 4, "span1": 5}, max_off_policy_threshold=2, refill=refills.append
    )
    batch, metrics = buffer.sample(5, 2, poll=no_poll)
    assert refills == [2]
    assert non_tensor_column(batch, "uid") == ["span2", "span2", "span1", "span1"]
    assert buffer.finished_count() == 0
    for uid in ("span6", "span4"):
        with pytest.raises(KeyError):
            buffer.status(uid)
    assert {name: value for name, value in metrics.items() if "evicted" in name} == {
        "training/off_policy/evicted_samples": 2.0,
        "training/off_policy/evicted_samples_staleness/mean": 5.0,
        "training/off_policy/evicted_samples_staleness/max": 6.0,
        "training/off_policy/evicted_samples_staleness/min": 4.0,
        "training/rollout_failure/evicted_samples": 0.0,
    }


def test_drop_refills_each_round_and_sums_the_eviction_metrics_over_the_loop():
    buffer = ReplayBuffer(pad_token_id=PAD, max_off_policy_threshold=2)
    refills = []

    def refill(count: int) -> None:
        refills.append(count)
        uids = [f"fresh{len(refills)}_{number}" for number in range(count)]
        buffer.add_prompts(uids, 5)

    def poll(interval_s: float) -> None:  # the stale in-flight group lands, as do the refills
        if "late" in buffer.in_flight():
            buffer.finish("late", make_group(2))
        for uid in buffer.in_flight():
            buffer.finish(uid, make_group(3))

    buffer.refill = refill
    buffer.add_prompts(["stale"], 0)
    buffer.finish("stale", make_group(1))
    buffer.add_prompts(["late"], 1)
    batch, metrics = buffer.sample(5, 2, poll=poll)
    assert refills == [1, 1]
    assert non_tensor_column(batch, "uid") == ["fresh1_0"] * 2 + ["fresh2_0"] * 2
    assert metrics["training/off_policy/evicted_samples"] == 2.0
    assert metrics["training/off_policy/evicted_samples_staleness/mean"] == 5.5
    assert metrics["training/off_policy/evicted_samples_staleness/max"] == 6.0
    assert metrics["training/off_policy/evicted_samples_staleness/min"] == 5.0


def test_without_refill_evicted_groups_are_not_replaced():
    buffer = buffer_with({"stale": 0, "fresh": 5}, max_off_policy_threshold=2)
    batch, metrics = buffer.sample(5, 1, poll=no_poll)
    assert non_tensor_column(batch, "uid") == ["fresh", "fresh"]
    assert metrics["training/off_policy/evicted_samples"] == 1.0
    assert buffer.in_flight() == {} and buffer.finished_count() == 0


# -- wait ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("running", [False, True])
def test_wait_blocks_on_a_stale_in_flight_prompt_until_poll_finishes_it(running):
    buffer = buffer_with({"stale": 0, "fresh": 5}, max_off_policy_threshold=2, max_off_policy_strategy="wait")
    buffer.add_prompts(["slow"], 4)  # span 2 at step 5: at the threshold, so it blocks
    if running:
        buffer.mark_running("slow")
    polls = []

    def poll(interval_s: float) -> None:
        polls.append(interval_s)
        buffer.finish("slow", make_group(7))

    batch, metrics = buffer.sample(5, 2, poll=poll, poll_interval_s=0.01)
    assert polls == [0.01]
    assert non_tensor_column(batch, "uid") == ["stale", "stale", "slow", "slow"]  # the stale group is returned
    assert metrics["training/off_policy/evicted_samples"] == 0.0
    assert "training/off_policy/evicted_samples_staleness/mean" not in metrics
    assert buffer.status("fresh") == "finished"


def test_wait_does_not_block_on_in_flight_prompts_below_the_threshold():
    buffer = buffer_with({"a": 4}, max_off_policy_threshold=2, max_off_policy_strategy="wait")
    buffer.add_prompts(["young"], 5)  # span 1
    buffer.add_prompts(["val_old"], 0, partition="val")  # val prompts never block train sampling
    batch, _ = buffer.sample(5, 1, poll=no_poll)
    assert non_tensor_column(batch, "uid") == ["a", "a"]


def test_timeout_names_what_was_found_and_what_blocks():
    buffer = buffer_with({"a": 1})
    with pytest.raises(TimeoutError, match=r"found 1 finished group\(s\), wanted 2"):
        buffer.sample(1, 2, poll=no_poll, timeout_s=0)
    waiting = buffer_with({"a": 1}, max_off_policy_threshold=1, max_off_policy_strategy="wait")
    waiting.add_prompts(["slow"], 1)
    with pytest.raises(TimeoutError, match=r"found 1 finished group\(s\), wanted 1; 1 in-flight prompt"):
        waiting.sample(1, 1, poll=no_poll, timeout_s=0)
    assert waiting.finished_count() == 1


# -- failures and validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["drop", "wait"])
def test_failed_groups_are_evicted_and_refilled(strategy):
    refills = []
    buffer = buffer_with({"ok": 1}, max_off_policy_strategy=strategy, refill=refills.append)
    buffer.add_prompts(["bad1", "bad2"], 1)
    buffer.fail("bad1", "timeout")
    buffer.fail("bad2", "tool error")
    batch, metrics = buffer.sample(1, 1, poll=no_poll)
    assert refills == [2]
    assert non_tensor_column(batch, "uid") == ["ok", "ok"]
    assert metrics["training/rollout_failure/evicted_samples"] == 2.0
    assert metrics["training/off_policy/evicted_samples"] == 0.0
    with pytest.raises(KeyError):
        buffer.status("bad1")


def test_val_never_evicts_and_returns_what_did_not_fail():
    refills = []
    buffer = ReplayBuffer(pad_token_id=PAD, max_off_policy_threshold=1, refill=refills.append)
    buffer.add_prompts(["train_stale"], 0)
    buffer.finish("train_stale", make_group(1))
    buffer.add_prompts(["v_old", "v_failed", "v_late"], 0, partition="val")
    buffer.finish("v_old", make_group(2))
    buffer.fail("v_failed", "timeout")

    def poll(interval_s: float) -> None:
        buffer.finish("v_late", make_group(3))

    batch, metrics = buffer.sample(10, 3, partition="val", poll=poll)
    assert non_tensor_column(batch, "uid") == ["v_old", "v_old", "v_late", "v_late"]  # span 11, kept
    assert batch["group_index"].tolist() == [0, 0, 1, 1]
    assert metrics["validation/off_policy/evicted_samples"] == 0.0
    assert metrics["validation/rollout_failure/evicted_samples"] == 1.0
    assert not any(name.startswith("training/") for name in metrics)
    assert refills == []
    assert buffer.status("train_stale") == "finished"  # a val sample leaves the train partition alone
    buffer.add_prompts(["v_gone"], 10, partition="val")
    buffer.fail("v_gone", "timeout")
    with pytest.raises(RuntimeError, match="no val group"):
        buffer.sample(10, 1, partition="val", poll=no_poll)


def test_trajectory_span_and_staleness_metrics():
    buffer = ReplayBuffer(pad_token_id=PAD)
    buffer.add_prompts(["a"], 7)
    buffer.finish("a", make_group(1, oldest=[3, 5], newest=[6, 5]))
    _, metrics = buffer.sample(8, 1, poll=no_poll)
    # spans: newest - oldest + 1 = [4, 1]; staleness: 7 - newest = [1, 2]; worst: 7 - oldest = [4, 2]
    assert {name: value for name, value in metrics.items() if "trajectory" in name} == {
        "training/off_policy/trajectory_spans/mean": 2.5,
        "training/off_policy/trajectory_spans/max": 4.0,
        "training/off_policy/trajectory_spans/min": 1.0,
        "training/off_policy/trajectory_staleness/mean": 1.5,
        "training/off_policy/trajectory_staleness/max": 2.0,
        "training/off_policy/trajectory_staleness/min": 1.0,
        "training/off_policy/trajectory_staleness_worst/mean": 3.0,
        "training/off_policy/trajectory_staleness_worst/max": 4.0,
        "training/off_policy/trajectory_staleness_worst/min": 2.0,
    }


# -- custom sampler -----------------------------------------------------------------------------------------


def test_load_sampler_default_and_custom(tmp_path):
    assert load_sampler(None, None) is ReplayBuffer
    path = tmp_path / "my_sampler.py"
    path.write_text(
        "from dataclasses import dataclass\n"
        "from ppoflow.storage.replay_buffer import ReplayBuffer\n\n"
        "class NewestFirst(ReplayBuffer):\n    pass\n\n"
        "@dataclass\nclass NotASampler:\n    size: int = 0\n"
    )
    sampler = load_sampler(str(path), "NewestFirst")
    assert issubclass(sampler, ReplayBuffer) and sampler.__name__ == "NewestFirst"
    instance = sampler(pad_token_id=PAD, max_off_policy_threshold=3, max_off_policy_strategy="wait", refill=None)
    assert instance.max_off_policy_threshold == 3
    assert load_sampler(str(path), "NewestFirst") is not sampler  # a fresh module each time

    with pytest.raises(ValueError, match=r"custom_sampler\.path=.*no such file"):
        load_sampler(str(tmp_path / "absent.py"), "NewestFirst")
    with pytest.raises(ValueError, match=r"custom_sampler\.name='Absent'"):
        load_sampler(str(path), "Absent")
    with pytest.raises(ValueError, match=r"custom_sampler\.name='NotASampler'.*not a subclass"):
        load_sampler(str(path), "NotASampler")
    with pytest.raises(ValueError, match=r"custom_sampler\.path and .*custom_sampler\.name must be set together"):
        load_sampler(str(path), None)
    broken = tmp_path / "broken.py"
    broken.write_text("class Sampler(:\n")
    with pytest.raises(ValueError, match=r"custom_sampler\.path=.*SyntaxError"):
        load_sampler(str(broken), "Sampler")
    assert load_sampler("ppoflow.storage.replay_buffer", "ReplayBuffer") is ReplayBuffer  # a module name works too
