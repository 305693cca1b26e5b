"""Hand-computed checks of algorithms.correction (verl's rollout correction semantics)."""

import math
import re

import pytest
import torch
from torch.testing import assert_close

from ppoflow.algorithms.correction import compute_rejection_mask, compute_rollout_is_weights, parse_is_threshold

T = torch.tensor

# ---------------------------------------------------------------- parse_is_threshold


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (2.0, (None, 2.0)),
        (2, (None, 2.0)),
        ("2.0", (None, 2.0)),
        (" 1.5 ", (None, 1.5)),
        ("0.5_2.0", (0.5, 2.0)),
        ("1_1", (1.0, 1.0)),
    ],
)
def test_parse_is_threshold_valid(value, expected):
    assert parse_is_threshold(value) == expected


@pytest.mark.parametrize("value", [True, False, None, [2.0]])
def test_parse_is_threshold_type_errors(value):
    with pytest.raises(TypeError):
        parse_is_threshold(value)


@pytest.mark.parametrize("value", [0, -1.0, "0", "2.0_0.5", "0_2", "-1_2", "abc", "", "0.5_x"])
def test_parse_is_threshold_value_errors_name_the_value(value):
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        parse_is_threshold(value)


# ---------------------------------------------------------------- IS weights
# rollout_log_prob = 0 and old_log_prob = log(ratio); the last token of row 1 is padding with a huge ratio 100.
RATIOS = [[0.5, 1.0, 3.0], [2.0, 1.5, 100.0]]
OLD = T([[math.log(r) for r in row] for row in RATIOS])
ROLLOUT = torch.zeros(2, 3)
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
P = "rollout_corr/"


def test_token_tis_truncates_and_masks():
    w, m = compute_rollout_is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    # clamp at 2: [[0.5, 1, 2], [2, 1.5, 0 (padding)]]
    assert_close(w, T([[0.5, 1.0, 2.0], [2.0, 1.5, 0.0]]))
    assert m[P + "rollout_is_mean"] == pytest.approx(7.0 / 5)  # (0.5 + 1 + 2 + 2 + 1.5) / 5
    assert m[P + "rollout_is_max"] == pytest.approx(2.0)
    assert m[P + "rollout_is_min"] == pytest.approx(0.5)
    assert m[P + "rollout_is_frac_truncated"] == pytest.approx(1.0 / 5)  # only 3.0 > 2 (2.0 itself is not)
    assert all(k.startswith(P) for k in m)


def test_token_icepop_zeroes_outside_bounds():
    w, m = compute_rollout_is_weights(OLD, ROLLOUT, MASK.bool(), level="token", threshold="0.6_2.5")
    # 0.5 < 0.6 and 3.0 > 2.5 are zeroed ; the others kept as is (no truncation)
    assert_close(w, T([[0.0, 1.0, 0.0], [2.0, 1.5, 0.0]]))
    assert m[P + "rollout_is_frac_zeroed"] == pytest.approx(2.0 / 5)
    assert m[P + "rollout_is_mean"] == pytest.approx(4.5 / 5)
    assert m[P + "rollout_is_min"] == pytest.approx(0.0)
    assert m[P + "rollout_is_max"] == pytest.approx(2.0)


def test_token_batch_normalize():
    w, m = compute_rollout_is_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0, batch_normalize=True)
    # mean over valid tokens 7/5 = 1.4 -> divide by 1.4
    assert_close(w, T([[0.5, 1.0, 2.0], [2.0, 1.5, 0.0]]) / 1.4)
    assert m[P + "rollout_is_batch_norm_factor"] == pytest.approx(1.4)
    assert m[P + "rollout_is_mean"] == pytest.approx(1.4)  # metric is pre-normalisation


def test_sequence_level_is_broadcast_and_truncated():
    w, m = compute_rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=2.0)
    # row 0: exp(ln0.5 + ln1 + ln3) = 1.5 on all 3 tokens
    # row 1: exp(ln2 + ln1.5) = 3 (the padding's ln100 is not summed) -> truncated to 2 ; padding 0
    assert_close(w, T([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]]))
    assert m[P + "rollout_is_frac_truncated"] == pytest.approx(2.0 / 5)  # the 2 valid tokens of row 1
    assert m[P + "rollout_is_mean"] == pytest.approx(8.5 / 5)  # (3 * 1.5 + 2 * 2) / 5


def test_sequence_level_batch_normalize_averages_sequences():
    w, m = compute_rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=2.0, batch_normalize=True)
    # per-sequence weights 1.5 and 2 -> mean 1.75 (the token mean would be 1.7)
    assert_close(w, T([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]]) / 1.75)
    assert m[P + "rollout_is_batch_norm_factor"] == pytest.approx(1.75)


def test_sequence_level_icepop_zeroes_whole_sequence():
    w, m = compute_rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", threshold="0.5_1.6")
    # row 0 weight 1.5 in [0.5, 1.6] kept ; row 1 weight 3 > 1.6 -> zeroed
    assert_close(w, T([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))
    assert m[P + "rollout_is_frac_zeroed"] == pytest.approx(2.0 / 5)


def test_is_weights_detached_and_log_ratio_clamped():
    old = T([[50.0, 0.0]], requires_grad=True)
    w, _ = compute_rollout_is_weights(old, torch.zeros(1, 2), T([[1.0, 1.0]]), level="token", threshold=1e12)
    assert not w.requires_grad
    # log ratio 50 is clamped to 20 -> exp(20) ; 0 -> 1
    assert_close(w, T([[math.exp(20.0), 1.0]]))


def test_is_weights_bad_level_and_empty_mask():
    with pytest.raises(ValueError, match="'geometric'"):
        compute_rollout_is_weights(OLD, ROLLOUT, MASK, level="geometric", threshold=2.0)
    with pytest.raises(ValueError):
        compute_rollout_is_weights(OLD, ROLLOUT, torch.zeros(2, 3), level="token", threshold=2.0)


# ---------------------------------------------------------------- rejection sampling
# log r = old - rollout, with rollout = 0:
#   row 0: [0, 0.1, -0.1]          row 1: [1, 0, 5 (padding)]          row 2: [-0.5, 0.5, 0]
# k1 = -log r ; k2 = (log r)^2 / 2 ; k3 = e^{log r} - 1 - log r
#   k2: row 0 [0, .005, .005] ; row 1 [.5, 0] ; row 2 [.125, .125, 0]
#   k3: row 0 [0, .00517, .00484] ; row 1 [e - 2 = .71828, 0] ; row 2 [e^-.5 - .5 = .10653, e^.5 - 1.5 = .14872, 0]
RS_OLD = T([[0.0, 0.1, -0.1], [1.0, 0.0, 5.0], [-0.5, 0.5, 0.0]])
RS_ROLLOUT = torch.zeros(3, 3)
RS_MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # 8 valid tokens


@pytest.mark.parametrize(
    ("option", "threshold", "expected", "fraction"),
    [
        # token k2 <= 0.1 rejects row1 t0 (.5), row2 t0 and t1 (.125)
        ("token_k2", 0.1, [[1, 1, 1], [0, 1, 0], [0, 0, 1]], 3 / 8),
        # token k3 <= 0.12 rejects row1 t0 (.718), row2 t1 (.149) but keeps row2 t0 (.107): k3 is asymmetric
        ("token_k3", "0.12", [[1, 1, 1], [0, 1, 0], [1, 0, 1]], 2 / 8),
        # sums of k2: .01, .5 (padding's 12.5 ignored), .25 ; <= 0.2 keeps row 0 only
        ("seq_sum_k2", 0.2, [[1, 1, 1], [0, 0, 0], [0, 0, 0]], 5 / 8),
        # means of k2: .00333, .25, .08333 ; <= 0.2 rejects row 1 only
        ("seq_mean_k2", 0.2, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8),
        # max of k2: .005, .5, .125 ; <= 0.1 keeps row 0 only
        ("seq_max_k2", 0.1, [[1, 1, 1], [0, 0, 0], [0, 0, 0]], 5 / 8),
        # max of k3: .00517, .718, .149 ; <= 0.5 rejects row 1
        ("seq_max_k3", 0.5, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8),
        # token k1 in [ln 0.7, ln 1.7] = [-0.357, 0.531]: k1 row 0 [0, -.1, .1] kept ; row 1 t0 k1=-1 rejected ;
        # row 2 k1 [.5, -.5, 0]: t0 kept, t1 rejected (pi_rollout / pi_train = e^-.5 = .61 < .7)
        ("token_k1", "0.7_1.7", [[1, 1, 1], [0, 1, 0], [1, 0, 1]], 2 / 8),
        # a bare 2 means [1/2, 2] -> [-0.693, 0.693] ; sums of k1: 0, -1 (padding -5 ignored), 0 -> rejects row 1
        ("seq_sum_k1", 2.0, [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8),
        # means of k1: 0, -0.5, 0 within [ln .7, ln 1.7]? -0.5 < -0.357 -> row 1 rejected
        ("seq_mean_k1", "0.7_1.7", [[1, 1, 1], [0, 0, 0], [1, 1, 1]], 2 / 8),
    ],
)
def test_rejection_single_option(option, threshold, expected, fraction):
    mask, metrics = compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options=option, thresholds=threshold)
    assert_close(mask, T(expected, dtype=torch.float32))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(fraction)
    assert metrics[f"rollout_corr/rollout_rs_{option}_masked_fraction"] == pytest.approx(fraction)


def test_rejection_options_are_anded_with_per_option_thresholds():
    mask, metrics = compute_rejection_mask(
        RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k2, seq_mean_k2", thresholds="0.1,0.2"
    )
    # token_k2 (<= .1) [[1,1,1],[0,1,0],[0,0,1]] AND seq_mean_k2 (<= .2) [[1,1,1],[0,0,0],[1,1,1]]
    assert_close(mask, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 8)
    assert metrics["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(3 / 8)
    assert metrics["rollout_corr/rollout_rs_seq_mean_k2_masked_fraction"] == pytest.approx(2 / 8)


def test_rejection_single_threshold_broadcast_and_list_thresholds():
    # 0.1 for both: token_k2 [[1,1,1],[0,1,0],[0,0,1]] AND seq_max_k2 [[1,1,1],[0,0,0],[0,0,0]]
    mask, _ = compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k2,seq_max_k2", thresholds=0.1)
    assert_close(mask, T([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # token_k1 in [.7, 1.7] [[1,1,1],[0,1,0],[1,0,1]] AND token_k2 <= .1 [[1,1,1],[0,1,0],[0,0,1]]
    mask, _ = compute_rejection_mask(
        RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k1,token_k2", thresholds=["0.7_1.7", 0.1]
    )
    assert_close(mask, T([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))


def test_rejection_keeps_mask_dtype():
    mask, _ = compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK.bool(), options="seq_mean_k2", thresholds=0.2)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, True, True], [False, False, False], [True, True, True]]
    mask, _ = compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK.long(), options="seq_mean_k2", thresholds=0.2)
    assert mask.dtype == torch.int64
    assert mask.tolist() == [[1, 1, 1], [0, 0, 0], [1, 1, 1]]


def test_rejection_errors():
    with pytest.raises(ValueError, match=r"'seq_max_k1'.*token_k1"):
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="seq_max_k1", thresholds=2.0)
    with pytest.raises(ValueError):
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options=" , ", thresholds=2.0)
    with pytest.raises(ValueError, match="2 thresholds for 3 options"):
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k1,token_k2,token_k3", thresholds="2.0,0.1")
    with pytest.raises(ValueError, match="'token_k2'.*single upper bound"):
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k2", thresholds="0.5_2.0")
    with pytest.raises(ValueError, match="'2.0_0.5'"):
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k1", thresholds="2.0_0.5")
    with pytest.raises(TypeError):
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k2", thresholds=True)
    with pytest.raises(ValueError, match="'token_k1'.*needs a bound >= 1"):  # [1/0.5, 0.5] would reject all
        compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k1", thresholds=0.5)
    for nan in ("nan", "nan_2", "0.5_nan"):
        with pytest.raises(ValueError, match="NaN"):
            compute_rejection_mask(RS_OLD, RS_ROLLOUT, RS_MASK, options="token_k1", thresholds=nan)
