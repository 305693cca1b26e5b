"""Hand-computed checks of algorithms.kl (verl semantics)."""

import math

import pytest
import torch
from torch.testing import assert_close

from ppoflow.algorithms.kl import (
    KL_PENALTY_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)

T = torch.tensor

# x = log_prob - ref_log_prob = [1, -1]
LOGP = T([0.0, -1.0])
REF = T([-1.0, 0.0])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [1.0, -1.0]),
        ("k1", [1.0, -1.0]),
        ("abs", [1.0, 1.0]),
        ("mse", [0.5, 0.5]),  # 0.5 * 1^2
        ("k2", [0.5, 0.5]),
        # k3: y = ref - logp = [-1, 1] ; e^y - y - 1 = e^-1 + 1 - 1 = 0.36788 ; e - 1 - 1 = 0.71828
        ("low_var_kl", [math.exp(-1), math.e - 2]),
        ("k3", [math.exp(-1), math.e - 2]),
    ],
)
def test_kl_forward_values(kind, expected):
    assert_close(kl_penalty(LOGP, REF, kind), T(expected))
    # the '+' variant keeps the forward value
    assert_close(kl_penalty(LOGP, REF, kind + "+"), T(expected))


def test_low_var_kl_clamps():
    # y = ref - logp = 30 -> clamped to 20 -> e^20 - 21 ~ 4.9e8 -> clamped to 10
    # y = -30 -> clamped to -20 -> e^-20 + 19 ~ 19 -> clamped to 10 ; y = 1000 stays finite (10)
    out = kl_penalty(T([0.0, 30.0, 0.0]), T([30.0, 0.0, 1000.0]), "low_var_kl")
    assert_close(out, T([10.0, 10.0, 10.0]))


@pytest.mark.parametrize("kind", ["k1+", "kl+", "abs+", "k3+", "low_var_kl+"])
def test_straight_through_gradient_is_k2_gradient(kind):
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_penalty(logp, ref, kind).sum().backward()
    # d/dlogp 0.5 (logp - ref)^2 = logp - ref = [1, -1] ; d/dref = -(logp - ref) = [-1, 1]
    assert_close(logp.grad, T([1.0, -1.0]))
    assert_close(ref.grad, T([-1.0, 1.0]))


def test_plain_k1_and_k3_gradients_differ_from_k2():
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, "k1").sum().backward()
    assert_close(logp.grad, T([1.0, 1.0]))  # d(logp - ref)/dlogp = 1
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, "k3").sum().backward()
    # d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp) = [1 - e^-1, 1 - e]
    assert_close(logp.grad, T([1 - math.exp(-1), 1 - math.e]))


def test_k2_plus_is_plain_k2():
    logp = LOGP.clone().requires_grad_(True)
    out = kl_penalty(logp, REF, "k2+")
    out.sum().backward()
    assert_close(out, T([0.5, 0.5]))
    assert_close(logp.grad, T([1.0, -1.0]))


def test_full_and_unknown_kinds():
    with pytest.raises(NotImplementedError):
        kl_penalty(LOGP, REF, "full")
    with pytest.raises(NotImplementedError):
        kl_penalty(LOGP, REF, "full+")
    with pytest.raises(ValueError, match=r"'k4'.*low_var_kl"):
        kl_penalty(LOGP, REF, "k4")


def test_kinds_listing():
    assert set(KL_PENALTY_KINDS) == {
        "kl",
        "k1",
        "abs",
        "mse",
        "k2",
        "low_var_kl",
        "k3",
        "kl+",
        "k1+",
        "abs+",
        "mse+",
        "k2+",
        "low_var_kl+",
        "k3+",
    }


# ---------------------------------------------------------------- controllers


def test_fixed_controller_is_constant_and_checkpointable():
    ctl = FixedKLController(0.1)
    ctl.update(current_kl=50.0, n_steps=1000)
    assert ctl.value == 0.1
    other = FixedKLController(0.5)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.1


def test_adaptive_controller_update_arithmetic():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    # error = 1.1/1 - 1 = 0.1 -> value *= 1 + 0.1 * 10 / 100 = 1.01 -> 0.101
    ctl.update(current_kl=1.1, n_steps=10)
    assert ctl.value == pytest.approx(0.101)
    # error = 5/1 - 1 = 4 -> clipped 0.2 -> value *= 1 + 0.2 * 10 / 100 = 1.02 -> 0.10302
    ctl.update(current_kl=5.0, n_steps=10)
    assert ctl.value == pytest.approx(0.10302)
    # error = 0/1 - 1 = -1 -> clipped -0.2 -> value *= 1 - 0.2 * 50 / 100 = 0.9 -> 0.092718
    ctl.update(current_kl=0.0, n_steps=50)
    assert ctl.value == pytest.approx(0.092718)


def test_adaptive_controller_state_round_trip():
    ctl = AdaptiveKLController(0.1, 1.0, 100)
    ctl.update(current_kl=1.1, n_steps=10)  # 0.101
    resumed = AdaptiveKLController(0.1, 1.0, 100)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == pytest.approx(0.101)
    # 0.101 * 1.01 = 0.10201
    resumed.update(current_kl=1.1, n_steps=10)
    assert resumed.value == pytest.approx(0.10201)


def test_adaptive_controller_rejects_bad_horizon():
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)


def test_make_kl_controller():
    fixed = make_kl_controller("fixed", 0.2, 6.0, 10000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.2
    adaptive = make_kl_controller("adaptive", 0.2, 6.0, 10000)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.2, 6.0, 0)
    with pytest.raises(ValueError, match="'pid'"):
        make_kl_controller("pid", 0.2, 6.0, 10000)


# ---------------------------------------------------------------- in-reward penalty


def test_apply_kl_penalty_rewards_and_metric():
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    logp = T([[-1.0, -1.0, -1.0], [-1.0, -2.0, -3.0]])
    ref = T([[-1.5, -1.0, -1.3], [-1.0, -1.0, -1.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # kl = logp - ref = [[0.5, 0, 0.3], [0, -1, (-2 masked -> 0)]]
    # rewards = scores - 0.5 * kl = [[-0.25, 0, 1 - 0.15], [0, 2 + 0.5, 0]]
    # current_kl = mean(0.8 / 3, -1 / 2) = (0.266667 - 0.5) / 2 = -0.116667
    rewards, current_kl = apply_kl_penalty(scores, logp, ref, mask.bool(), kl_coef=0.5, kind="kl")
    assert_close(rewards, T([[-0.25, 0.0, 0.85], [0.0, 2.5, 0.0]]))
    assert isinstance(current_kl, float)
    assert current_kl == pytest.approx((0.8 / 3 - 0.5) / 2)


def test_apply_kl_penalty_all_masked_sequence_counts_as_zero():
    scores = torch.zeros(2, 2)
    logp = T([[0.0, 0.0], [0.0, 0.0]])
    ref = T([[-1.0, -3.0], [-5.0, -5.0]])
    mask = T([[1.0, 1.0], [0.0, 0.0]])
    # abs kl row 0 = [1, 3] -> mean 2 ; row 1 fully masked -> 0 ; batch mean (2 + 0) / 2 = 1
    rewards, current_kl = apply_kl_penalty(scores, logp, ref, mask, kl_coef=0.1, kind="abs")
    assert_close(rewards, T([[-0.1, -0.3], [0.0, 0.0]]))
    assert current_kl == pytest.approx(1.0)
