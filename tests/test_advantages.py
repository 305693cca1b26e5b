"""Hand-computed checks of algorithms.advantages and algorithms.masked (verl semantics)."""

import math

import pytest
import torch
from torch.testing import assert_close

from ppoflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
)
from ppoflow.algorithms.masked import masked_mean, masked_var, masked_whiten

T = torch.tensor

# ---------------------------------------------------------------- masked statistics


def test_masked_mean_all_and_per_row_and_bool_mask():
    values = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 4) / 3
    assert_close(masked_mean(values, mask), T(7.0 / 3))
    assert_close(masked_mean(values, mask.bool()), T(7.0 / 3))
    # row 0: (1 + 2) / 2 ; row 1: 4 / 1
    assert_close(masked_mean(values, mask, dim=-1), T([1.5, 4.0]))


def test_masked_mean_empty_row_is_zero_and_nan_outside_mask_ignored():
    values = T([[float("nan"), 2.0], [7.0, 9.0]])
    mask = T([[0.0, 1.0], [0.0, 0.0]])
    # row 0: 2 / 1 ; row 1: 0 / (0 + 1e-8) = 0
    assert_close(masked_mean(values, mask, dim=-1), T([2.0, 0.0]))


def test_masked_var_unbiased_and_biased():
    values = T([1.0, 2.0, 3.0, 100.0])
    mask = T([True, True, True, False])
    # mean 2; squared deviations 1, 0, 1 -> biased 2/3, unbiased 2/2 = 1
    assert_close(masked_var(values, mask, unbiased=False), T(2.0 / 3))
    assert_close(masked_var(values, mask), T(1.0))


def test_masked_var_rejects_zero_or_one_element():
    with pytest.raises(ValueError):
        masked_var(T([1.0, 2.0]), T([1.0, 0.0]))
    with pytest.raises(ValueError):
        masked_var(T([1.0, 2.0]), T([0.0, 0.0]))


def test_masked_whiten():
    values = T([1.0, 2.0, 3.0, 100.0])
    mask = T([1.0, 1.0, 1.0, 0.0])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8); the masked element is transformed too
    assert_close(masked_whiten(values, mask), T([-1.0, 0.0, 1.0, 98.0]))
    # shift_mean=False adds the mean back: (x - 2) / 1 + 2
    assert_close(masked_whiten(values, mask, shift_mean=False), T([1.0, 2.0, 3.0, 100.0]))


# ---------------------------------------------------------------- GAE

# gamma = 0.5, lam = 0.5 (gamma * lam = 0.25)
GAE_REWARDS = T([[0.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
GAE_VALUES = T([[2.0, 2.0, 2.0, 0.0], [1.0, 8.0, 1.0, 1.0]])
GAE_MASK = T([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
# row 0 (t=3 is padding: A=0, V_next stays 0):
#   t=2: delta = 4 + 0.5*0 - 2 = 2          A = 2
#   t=1: delta = 0 + 0.5*2 - 2 = -1         A = -1 + 0.25*2 = -0.5
#   t=0: delta = 0 + 0.5*2 - 2 = -1         A = -1 + 0.25*(-0.5) = -1.125
# row 1 (t=1 is an observation token with a garbage value 8 that must be skipped):
#   t=3: delta = 2 + 0 - 1 = 1              A = 1
#   t=2: delta = 0 + 0.5*1 - 1 = -0.5       A = -0.5 + 0.25*1 = -0.25
#   t=1: masked: carries V_next = 1 and A_next = -0.25 (stored there: -0.25)
#   t=0: delta = 0 + 0.5*1 - 1 = -0.5       A = -0.5 + 0.25*(-0.25) = -0.5625
GAE_RAW_ADV = T([[-1.125, -0.5, 2.0, 0.0], [-0.5625, -0.25, -0.25, 1.0]])
# returns = A + V
GAE_RETURNS = T([[0.875, 1.5, 4.0, 0.0], [0.4375, 7.75, 0.75, 2.0]])
# whitening over the 6 valid entries -1.125, -0.5, 2, -0.5625, -0.25, 1:
#   mean = 0.5625 / 6 = 0.09375 ; sum of squared deviations = 6.841796875 ; unbiased var = 6.841796875 / 5
GAE_ADV = (GAE_RAW_ADV - 0.09375) / math.sqrt(6.841796875 / 5)


def test_gae_backward_loop_with_observation_token_and_padding():
    adv, ret = compute_gae_advantage_return(GAE_REWARDS, GAE_VALUES, GAE_MASK, gamma=0.5, lam=0.5)
    assert_close(ret, GAE_RETURNS)
    assert_close(adv, GAE_ADV)


def test_gae_bool_mask_same_result():
    adv, ret = compute_gae_advantage_return(GAE_REWARDS, GAE_VALUES, GAE_MASK.bool(), gamma=0.5, lam=0.5)
    assert_close(ret, GAE_RETURNS)
    assert_close(adv, GAE_ADV)


# ---------------------------------------------------------------- outcome estimators

# index [7, 3, 7, 7]: group 7 = samples 0, 2, 3 ; group 3 = sample 1 alone.
OUT_INDEX = T([7, 3, 7, 7])
OUT_REWARDS = T([[0.0, 1.0], [0.0, 5.0], [2.0, 0.0], [1.0, 2.0]])  # scores s = 1, 5, 2, 3
OUT_MASK = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])


def test_grpo_group_normalisation_and_singleton():
    # group 7: scores 1, 2, 3 -> mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    # singleton group 3: mean 0, std 1 -> 5 / (1 + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    expected = T([[-b, -b], [5 * b, 5 * b], [0.0, 0.0], [b, b]])
    adv, ret = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, OUT_INDEX)
    assert_close(adv, expected)
    assert_close(ret, expected)


def test_grpo_uses_unbiased_std():
    # group of two with scores 0 and 1: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 1/sqrt(2)
    # -> A = +-0.5 * sqrt(2) = +-0.70711 (a biased std of 0.5 would give +-1)
    a = 0.5 / (1 / math.sqrt(2) + 1e-6)
    adv, _ = compute_grpo_outcome_advantage(T([[0.0], [1.0]]), T([[1.0], [1.0]]), T([0, 0]))
    assert_close(adv, T([[-a], [a]]))


def test_grpo_constant_group_gives_zero():
    # scores 2, 2: mean 2, std 0 -> 0 / (0 + 1e-6) = 0
    adv, _ = compute_grpo_outcome_advantage(T([[2.0], [2.0]]), T([[1.0], [1.0]]), T([4, 4]))
    assert_close(adv, T([[0.0], [0.0]]))


def test_dr_grpo_no_std_division():
    # s - mean_g: 1-2, 5-0 (singleton), 2-2, 3-2 ; masked token of sample 2 stays 0
    expected = T([[-1.0, -1.0], [5.0, 5.0], [0.0, 0.0], [1.0, 1.0]])
    adv, _ = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK.bool(), OUT_INDEX, norm_adv_by_std_in_grpo=False)
    assert_close(adv, expected)


# RLOO, group 7 (K=3): s minus the mean of the others
#   s=1: 1 - (2+3)/2 = -1.5 ; s=2: 2 - (1+3)/2 = 0 ; s=3: 3 - (1+2)/2 = 1.5 ; singleton s=5 stays 5
RLOO_EXPECTED = T([[-1.5, -1.5], [5.0, 5.0], [0.0, 0.0], [1.5, 1.5]])


def test_rloo_leave_one_out_and_singleton_unchanged():
    adv, ret = compute_rloo_outcome_advantage(OUT_REWARDS, OUT_MASK, OUT_INDEX)
    assert_close(adv, RLOO_EXPECTED)
    assert_close(ret, RLOO_EXPECTED)


def test_rloo_masks_tokens():
    # group of 2 with scores 4 and 0: 4 - 0 = 4 and 0 - 4 = -4 ; second token of sample 0 masked out
    adv, _ = compute_rloo_outcome_advantage(T([[4.0, 0.0], [0.0, 0.0]]), T([[1.0, 0.0], [1.0, 1.0]]), T([1, 1]))
    assert_close(adv, T([[4.0, 0.0], [-4.0, -4.0]]))


# REINFORCE++ with gamma = 0.5
RPP_REWARDS = T([[1.0, 0.0, 2.0], [0.0, 9.0, 4.0]])
RPP_MASK = T([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
# row 0: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
# row 1: G2 = 4; t=1 is masked: return 0 there, its reward 9 is skipped and the running 4 carries;
#        G0 = 0 + 0.5*4 = 2
RPP_RETURNS = T([[1.5, 1.0, 2.0], [2.0, 0.0, 4.0]])
# whiten over 1.5, 1, 2, 2, 4: mean 10.5/5 = 2.1 ; squared deviations .36+1.21+.01+.01+3.61 = 5.2 ; var 5.2/4 = 1.3
RPP_ADV = (RPP_RETURNS - 2.1) / math.sqrt(1.3) * RPP_MASK


def test_reinforce_plus_plus_discounted_return_and_whitening():
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(RPP_REWARDS, RPP_MASK, gamma=0.5)
    assert_close(ret, RPP_RETURNS)
    assert_close(adv, RPP_ADV)


# REINFORCE++-baseline: index [0, 0, 1], scores 3, 1, 2
RPPB_REWARDS = T([[1.0, 2.0], [0.0, 1.0], [2.0, 0.0]])
RPPB_MASK = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
RPPB_INDEX = T([0, 0, 1])
# s - mean_g: 3-2 = 1, 1-2 = -1, singleton 2-0 = 2 ; tiled and masked: [[1,1],[-1,-1],[2,0]]
# whiten over 1, 1, -1, -1, 2: mean 0.4 ; squared deviations .36+.36+1.96+1.96+2.56 = 7.2 ; var 7.2/4 = 1.8
RPPB_ADV = T([[0.6, 0.6], [-1.4, -1.4], [1.6, 0.0]]) / math.sqrt(1.8)


def test_reinforce_plus_plus_baseline():
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(RPPB_REWARDS, RPPB_MASK, RPPB_INDEX)
    assert_close(adv, RPPB_ADV)
    assert_close(ret, RPPB_ADV)


# ---------------------------------------------------------------- dispatcher


def test_registry_constants():
    assert ADVANTAGE_ESTIMATORS == ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


@pytest.mark.parametrize(
    ("estimator", "kwargs", "expected_adv", "expected_ret"),
    [
        (
            "gae",
            dict(
                token_level_rewards=GAE_REWARDS,
                response_mask=GAE_MASK,
                index=T([0, 1]),
                values=GAE_VALUES,
                gamma=0.5,
                lam=0.5,
            ),
            GAE_ADV,
            GAE_RETURNS,
        ),
        (
            "grpo",
            dict(
                token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK, index=OUT_INDEX, norm_adv_by_std_in_grpo=False
            ),
            T([[-1.0, -1.0], [5.0, 5.0], [0.0, 0.0], [1.0, 1.0]]),
            T([[-1.0, -1.0], [5.0, 5.0], [0.0, 0.0], [1.0, 1.0]]),
        ),
        (
            "rloo",
            dict(token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK, index=OUT_INDEX),
            RLOO_EXPECTED,
            RLOO_EXPECTED,
        ),
        (
            "reinforce_plus_plus",
            dict(token_level_rewards=RPP_REWARDS, response_mask=RPP_MASK, index=T([0, 1]), gamma=0.5),
            RPP_ADV,
            RPP_RETURNS,
        ),
        (
            "reinforce_plus_plus_baseline",
            dict(token_level_rewards=RPPB_REWARDS, response_mask=RPPB_MASK, index=RPPB_INDEX),
            RPPB_ADV,
            RPPB_ADV,
        ),
    ],
)
def test_dispatcher_routes_and_forwards_arguments(estimator, kwargs, expected_adv, expected_ret):
    adv, ret = compute_advantage(estimator, **kwargs)
    assert_close(adv, expected_adv)
    assert_close(ret, expected_ret)


def test_dispatcher_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match=r"'ppo_magic'.*gae.*grpo.*rloo.*reinforce_plus_plus_baseline"):
        compute_advantage("ppo_magic", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK, index=OUT_INDEX)


def test_dispatcher_is_case_sensitive():
    with pytest.raises(ValueError, match="GRPO"):
        compute_advantage("GRPO", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK, index=OUT_INDEX)


def test_dispatcher_gae_without_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", token_level_rewards=GAE_REWARDS, response_mask=GAE_MASK, index=T([0, 1]))
