"""Validation metrics (algorithms/validation_metrics.py): verl's mean/std/best/worst/maj@n and pass@k, by hand,
against an independent reference (verl's definitions written out loop by loop) and against exact expectations
enumerated over every draw; and one in-process validation run that reports them from a scorer's acc and pred."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter

import numpy as np
import pytest

from ppoflow.algorithms.scoring import ScorerFailed, as_score, score_one, score_responses
from ppoflow.algorithms.validation_metrics import (
    bootstrap_sizes,
    majority_values,
    pass_at_k,
    pass_ks,
    prompt_metrics,
    validation_metrics,
)
from ppoflow.tasks.reward import extra_means

# ---------------------------------------------------------------------------- hand values


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (5, 1, 1, 0.2),  # pass@1 is the share that passes
        (10, 3, 4, 5 / 6),  # 1 - C(7,4)/C(10,4) = 1 - 35/210
        (4, 1, 4, 1.0),  # k > n - c: every draw of k holds a passing response
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_the_sizes_are_verls():
    sizes = [[], [2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8], [2, 4, 8, 16]]
    assert [bootstrap_sizes(n) for n in (1, 2, 3, 4, 5, 8, 16)] == sizes
    assert [pass_ks(n) for n in (1, 2, 4, 6, 8)] == [[1], [1, 2], [1, 2, 4], [1, 2, 4], [1, 2, 4, 8]]


def test_majority_takes_the_first_response_of_the_most_given_answer():
    values = np.array([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]])
    votes = np.array([[0, 1, 1, 0], [2, 1, 1, 0], [3, 1, 2, 1]])
    # a 2-2 tie goes to the answer given first (0: 0.1); 1 twice (0.2, its first); 1 twice again (0.2)
    assert majority_values(values, votes).tolist() == [0.1, 0.2, 0.2]


def test_two_prompts_of_four_by_hand():
    """Prompt a: rewards 1, 0, 0, 0; prompt b: 1, 1, 0, 1 (one data source)."""
    metrics = validation_metrics(["src"] * 8, ["a"] * 4 + ["b"] * 4, {"reward": [1, 0, 0, 0, 1, 1, 0, 1]})
    at = {
        name.removeprefix("val-core/src/reward/").removeprefix("val-aux/src/reward/"): v for name, v in metrics.items()
    }
    assert at["mean@4"] == pytest.approx((0.25 + 0.75) / 2)
    assert at["std@4"] == pytest.approx(math.sqrt(0.25 * 0.75))  # both prompts: sqrt(p(1-p)), population
    assert at["pass@1"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert at["pass@2"] == pytest.approx((0.5 + 1.0) / 2)  # a: 1 - C(3,2)/C(4,2); b: 1 - C(1,2)/C(4,2) = 1
    assert at["pass@4"] == 1.0
    assert sorted(name for name in metrics if name.startswith("val-core/")) == [
        "val-core/src/reward/best@4/mean",
        "val-core/src/reward/best@4/std",
        "val-core/src/reward/mean@4",
    ]  # no pred: no maj
    assert set(at) == {"mean@4", "std@4", "pass@1", "pass@2", "pass@4"} | {
        f"{kind}@{size}/{stat}" for kind in ("best", "worst") for size in (2, 4) for stat in ("mean", "std")
    }


def test_a_prompt_whose_responses_agree_has_no_spread():
    metrics = prompt_metrics([0.7] * 4, ["x"] * 4)
    for kind, size in itertools.product(("best", "worst", "maj"), (2, 4)):
        assert metrics[f"{kind}@{size}/mean"] == pytest.approx(0.7, abs=1e-12)
        assert metrics[f"{kind}@{size}/std"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["std@4"] == pytest.approx(0.0, abs=1e-12)


def test_one_response_a_prompt_is_its_mean_and_pass_at_1():
    metrics = validation_metrics(["s", "s"], ["p", "q"], {"reward": [1.0, 0.5]})
    assert metrics == {"val-core/s/reward/mean@1": 0.75, "val-aux/s/reward/pass@1": 0.5}  # 0.5 is no full credit


def test_acc_is_the_core_variable_when_the_scorer_reports_it():
    sources, uids = ["s"] * 4 + ["t"] * 4, ["p"] * 2 + ["q"] * 2 + ["r"] * 4
    rewards, accs = [1, -1, -1, -1, 1, 1, -1, 1], [True, False, False, False, True, True, False, True]
    preds = ["4", "5", "5", "4", "7", "7", "8", "7"]
    metrics = validation_metrics(sources, uids, {"reward": rewards, "acc": accs, "pred": preds})
    assert sorted(name for name in metrics if name.startswith("val-core/")) == [
        f"val-core/s/acc/{name}" for name in ("best@2/mean", "best@2/std", "maj@2/mean", "maj@2/std", "mean@2")
    ] + [f"val-core/t/acc/{name}" for name in ("best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std", "mean@4")]
    assert metrics["val-aux/s/reward/mean@2"] == pytest.approx(-0.5)  # p: 0, q: -1
    assert metrics["val-core/s/acc/mean@2"] == pytest.approx(0.25)
    assert metrics["val-aux/t/acc/pass@2"] == pytest.approx(1.0)  # 3 of 4 pass
    assert not any("/pred/" in name for name in metrics)  # the answers are voted on, not averaged
    assert not any("/reward/pass@" in name for name in metrics)  # pass@k: of the core variable


def test_columns_of_another_length_are_refused():
    with pytest.raises(ValueError, match="validation variable 'acc' has 1 values for 2 responses"):
        validation_metrics(["s", "s"], ["p", "p"], {"reward": [1, 0], "acc": [1]})


# ---------------------------------------------------------------------------- the bootstrap


def reference(values: list[float], preds: list, size: int) -> dict[str, tuple[float, float]]:
    """verl's bootstrap written out draw by draw: seed 42 in numpy's global generator, 1000 draws of ``size``
    responses with replacement; per draw the max, the min and the value of the first response giving the most
    common answer (a tie: the answer drawn first); each one's mean and population std over the draws."""
    saved = np.random.get_state()
    try:
        np.random.seed(42)
        draws = np.random.choice(len(values), size=(1000, size), replace=True)
    finally:
        np.random.set_state(saved)
    found: dict[str, list[float]] = {"best": [], "worst": [], "maj": []}
    for draw in draws:
        drawn = [values[i] for i in draw]
        found["best"].append(max(drawn))
        found["worst"].append(min(drawn))
        counts = Counter(preds[i] for i in draw)
        winner = max(counts, key=counts.get)  # Counter keeps first-seen order: ties go to the first drawn
        found["maj"].append(next(values[i] for i in draw if preds[i] == winner))
    return {kind: (float(np.mean(got)), float(np.std(got))) for kind, got in found.items()}


def expectation(values: list[float], preds: list, size: int) -> dict[str, tuple[float, float]]:
    """The exact mean and std of each per-draw statistic over every one of the ``N**size`` equally likely draws."""
    found: dict[str, list[float]] = {"best": [], "worst": [], "maj": []}
    for draw in itertools.product(range(len(values)), repeat=size):
        drawn = [values[i] for i in draw]
        found["best"].append(max(drawn))
        found["worst"].append(min(drawn))
        counts = Counter(preds[i] for i in draw)
        winner = max(counts, key=counts.get)
        found["maj"].append(next(values[i] for i in draw if preds[i] == winner))
    return {kind: (float(np.mean(got)), float(np.std(got))) for kind, got in found.items()}


PROMPTS = [
    ([1.0, 0.0, 0.0, 0.0], ["x", "y", "y", "z"]),
    ([0.9, 0.2, 0.5, 0.2, 0.0], ["4", "4", "5", "6", "5"]),
    ([1.0, 1.0, 0.0, 1.0, 0.0, 0.5], ["a", "a", "b", "a", "c", "b"]),
]


@pytest.mark.parametrize("values, preds", PROMPTS)
def test_the_bootstrap_is_verls_draw_for_draw(values, preds):
    metrics = prompt_metrics(values, preds)
    for size in bootstrap_sizes(len(values)):
        for kind, (mean, std) in reference(values, preds, size).items():
            assert metrics[f"{kind}@{size}/mean"] == pytest.approx(mean, abs=1e-12), (kind, size)
            assert metrics[f"{kind}@{size}/std"] == pytest.approx(std, abs=1e-12), (kind, size)


@pytest.mark.parametrize("values, preds", PROMPTS)
def test_the_bootstrap_estimates_the_exact_expectation(values, preds):
    """Each bootstrap mean lies within 4 standard errors (std / sqrt(1000)) of the mean over every draw."""
    metrics = prompt_metrics(values, preds)
    for size in [size for size in bootstrap_sizes(len(values)) if len(values) ** size <= 50_000]:
        for kind, (mean, std) in expectation(values, preds, size).items():
            assert abs(metrics[f"{kind}@{size}/mean"] - mean) <= 4 * std / math.sqrt(1000) + 1e-12, (kind, size)


def test_the_numbers_do_not_depend_on_the_order_of_the_prompts_or_the_run():
    sources, uids = ["s"] * 10, [0] * 5 + [1] * 5
    rewards, preds = PROMPTS[1][0] * 2, PROMPTS[1][1] * 2
    first = validation_metrics(sources, uids, {"reward": rewards, "pred": preds})
    swapped = validation_metrics(sources, uids[::-1], {"reward": rewards[::-1], "pred": preds[::-1]})
    assert first == validation_metrics(sources, uids, {"reward": rewards, "pred": preds})
    assert first.keys() == swapped.keys()
    assert first["val-core/s/reward/mean@5"] == pytest.approx(swapped["val-core/s/reward/mean@5"])


# ---------------------------------------------------------------------------- pred travels from the scorer


def test_a_scorer_may_report_its_answer_as_text():
    assert as_score({"score": 1, "acc": True, "pred": "42"}) == (1.0, {"acc": 1.0, "pred": "42"})
    assert extra_means({"acc": [1.0, 0.0], "pred": ["42", "41"]}) == {"reward/acc/mean": 0.5}
    for bad in ({"score": 1.0, "pred": ["42"]}, {"score": 1.0, "answer": "42"}):  # text under pred only

        def scorer(data_source, solution_str, ground_truth, extra_info=None, bad=bad):
            return bad

        with pytest.raises(ScorerFailed, match="returned a dict whose"):
            score_one("s", "x", "y", scorer, sample="a response")


def test_a_response_its_scorer_failed_on_keeps_the_others_extras_in_place():
    """A scorer with an ``error_score`` scores a failed response that and reports only ``scorer_errors`` for it:
    each response's extras still line up, and validation counts the failed one's acc 0 and no answer."""
    from ppoflow.flows.validation import extra_columns
    from ppoflow.tasks.reward import response_extras

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise RuntimeError("cannot parse")
        return {"score": 1.0, "acc": float(solution_str == ground_truth), "pred": solution_str}

    scorer.error_score = -1.0
    solutions = ["4", "boom", "5"]
    scores, extras = score_responses(["s"] * 3, solutions, ["4"] * 3, scorer)
    assert scores == [1.0, -1.0, 1.0]
    found = response_extras(extras, 3)
    assert found == [
        {"acc": 1.0, "pred": "4", "scorer_errors": 0.0},
        {"scorer_errors": 1.0},
        {"acc": 0.0, "pred": "5", "scorer_errors": 0.0},
    ]
    assert extra_columns(found) == {"acc": [1.0, 0.0, 0.0], "pred": ["4", None, "5"], "scorer_errors": [0.0, 1.0, 0.0]}
    assert response_extras({"acc": [1.0]}, 2) == [{}, {}]  # without the flag, an extra that does not fit is left out


# ---------------------------------------------------------------------------- a validation run

SCORER = """
import json
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open({calls!r}, "a") as calls:
        calls.write(json.dumps(solution_str) + "\\n")
    return {{"score": len(solution_str) % 3 / 2, "acc": len(solution_str) % 2 == 0, "pred": solution_str[:1]}}
"""


def test_a_validation_run_reports_verls_metrics_and_pass_at_k(tiny_overrides, tmp_path):
    """8 validation prompts x 4 sampled responses, scored by a custom scorer with acc and pred: validate reports
    acc as the core variable and every number equals the reference computed from the responses it scored."""
    from ppoflow.configs import load_config
    from ppoflow.flows.run import start_run
    from ppoflow.flows.validation import validate, validation_line

    calls = tmp_path / "calls.jsonl"
    (tmp_path / "my_reward.py").write_text(SCORER.format(calls=str(calls)))
    cfg = load_config(
        "grpo_tiny",
        tiny_overrides
        + [
            f"custom_reward_function.path={tmp_path}/my_reward.py",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        ],
    )
    run = start_run(cfg, orchestrated=False)
    try:
        calls.write_text("")  # the preflight's call on the first training row is not validation's
        metrics, samples = validate(run, step=0)
    finally:
        run.workers.shutdown()
    solutions = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(solutions) == 8 * 4  # in the batch's order: each prompt's 4 responses side by side
    source = "synthetic/copy"
    expected: dict[str, list[float]] = {}
    for prompt in range(8):
        group = solutions[4 * prompt : 4 * prompt + 4]
        accs = [float(len(text) % 2 == 0) for text in group]
        preds = [text[:1] for text in group]
        passed = sum(accs)
        rewards = [len(text) % 3 / 2 for text in group]
        found = {"acc/mean@4": np.mean(accs), "acc/std@4": np.std(accs), "reward/mean@4": np.mean(rewards)}
        found |= {f"acc/pass@{k}": pass_at_k(4, int(passed), k) for k in (1, 2, 4)}
        for size in (2, 4):
            for kind, (mean, std) in reference(accs, preds, size).items():
                found |= {f"acc/{kind}@{size}/mean": mean, f"acc/{kind}@{size}/std": std}
        for name, value in found.items():
            expected.setdefault(name, []).append(value)
    for name, values in expected.items():
        core = name.startswith("acc/") and name.split("/")[1] in ("mean@4", "best@4", "maj@4")
        key = f"{'val-core' if core else 'val-aux'}/{source}/{name}"
        assert metrics[key] == pytest.approx(np.mean(values), abs=1e-9), key
    assert {name for name in metrics if name.startswith("val-core/")} == {
        f"val-core/{source}/acc/{name}" for name in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std")
    }
    line = validation_line(0, metrics, samples)
    assert f"val-core/{source}/acc/maj@4/mean " in line and "/std" not in line and "val-aux" not in line


@pytest.mark.slow  # a rollout-service run (~9 s)
def test_a_validation_in_the_rollout_service_keeps_the_scorers_extras(prefect_api, ray_local, tiny_model, tmp_path):
    """The rollout service scores validation's trajectories as they finish: the extras it returns (the vault
    scorer's ``exact``) still reach the metrics, beside the reward's bootstrap over 2 responses a prompt."""
    from ppoflow.flows.tracking import read_metrics
    from ppoflow.flows.train import ppo_train

    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        f"data.train_files={tmp_path}/train.parquet",
        f"data.val_files={tmp_path}/val.parquet",
        "data.synthetic.copy_share=0",
        "data.synthetic.train_rows=16",
        "data.synthetic.val_rows=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "trainer.total_training_steps=1",
        "trainer.test_freq=1",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        "trainer.logger=[]",
        f"trainer.default_local_dir={tmp_path}/run",
    ]
    state = ppo_train(config="vault_tool", overrides=overrides, return_state=True)
    assert state.is_completed(), state
    (row,) = read_metrics(str(tmp_path / "run"))
    source = "synthetic/vault"
    assert "timing_s/reward" not in row  # scored while generating
    for name in ("mean@2", "best@2/mean", "best@2/std"):
        assert 0.0 <= row[f"val-core/{source}/reward/{name}"] <= 1.0, name
    for name in ("exact/mean@2", "exact/std@2", "exact/worst@2/mean", "reward/pass@1", "reward/pass@2"):
        assert 0.0 <= row[f"val-aux/{source}/{name}"] <= 1.0, name
    # vault scores 1 or 0 and exact is that score: the two variables agree
    assert row[f"val-aux/{source}/exact/mean@2"] == pytest.approx(row[f"val-core/{source}/reward/mean@2"])
    assert row[f"val-aux/{source}/reward/pass@1"] == pytest.approx(row[f"val-core/{source}/reward/mean@2"])
