"""Hand-computed checks of algorithms.losses (verl semantics)."""

import math

import pytest
import torch
from torch.testing import assert_close

from ppoflow.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_value_loss,
    log_probs_and_entropy,
)
from ppoflow.algorithms.policy_losses import compute_policy_loss

T = torch.tensor

# ---------------------------------------------------------------- agg_loss

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third sequence has no valid token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # sequence sums 3 and 4 (third excluded) -> 7 / 2
        ("seq-mean-token-mean", 2.75),  # sequence means 1.5 and 4 -> 5.5 / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # seq-mean-token-sum / horizon 3
    ],
)
def test_agg_loss_modes(mode, expected):
    assert_close(agg_loss(LOSS, MASK, mode), T(expected))
    assert_close(agg_loss(LOSS, MASK.bool(), mode), T(expected))


def test_agg_loss_global_normalisers_and_scale_factor():
    # 7 / 10 tokens ; 7 / 4 sequences ; (1.5 + 4) / 4 sequences ; (7 / 2) / 7
    assert_close(agg_loss(LOSS, MASK, "token-mean", num_tokens=10), T(0.7))
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=4), T(1.75))
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-mean", num_seqs=4), T(5.5 / 4))
    assert_close(agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=7.0), T(0.5))


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        # micro-batch A = row 0, micro-batch B = rows 1-2 ; global normalisers of the whole mini-batch
        ("token-mean", {"num_tokens": 3}, 7.0 / 3),  # (1+2)/3 + 4/3
        ("seq-mean-token-sum", {"num_seqs": 2}, 3.5),  # 3/2 + 4/2
        ("seq-mean-token-mean", {"num_seqs": 2}, 2.75),  # 1.5/2 + 4/2
    ],
)
def test_agg_loss_micro_batches_sum_to_mini_batch(mode, kwargs, expected):
    part_a = agg_loss(LOSS[:1], MASK[:1], mode, **kwargs)
    part_b = agg_loss(LOSS[1:], MASK[1:], mode, **kwargs)
    assert_close(part_a + part_b, T(expected))


def test_agg_loss_ignores_nan_outside_mask():
    loss = T([[1.0, float("nan")], [3.0, 5.0]])
    mask = T([[1.0, 0.0], [1.0, 1.0]])
    # token-mean (1 + 3 + 5) / 3 = 3 ; seq-mean-token-sum (1 + 8) / 2 = 4.5
    assert_close(agg_loss(loss, mask, "token-mean"), T(3.0))
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), T(4.5))


def test_agg_loss_unknown_mode():
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match=r"'token-sum'.*seq-mean-token-mean"):
        agg_loss(LOSS, MASK, "token-sum")


# ---------------------------------------------------------------- policy loss
# clip_ratio_low 0.2, clip_ratio_high 0.28 (clip range [0.8, 1.28]), clip_ratio_c 3
# old_log_prob = 0, so r = exp(log_prob)
#   a: A=+1, r=1.5 : L1=-1.5, L2=-1.28 -> max -1.28 (clipped)
#   b: A=+1, r=1.25: L1=L2=-1.25 (inside clip-higher; a symmetric 0.2 would clip it to -1.2)
#   c: A=-1, r=0.7 : L1=0.7, L2=0.8 -> 0.8 (clipped) ; dual cap 3 inactive
#   d: A=-1, r=4   : L1=4, L2=1.28 -> 4 ; dual cap -A*c = 3 -> 3 (pg_clipfrac_lower)
#   e: A=-2, r=1.1 : L1=L2=2.2 ; cap 6 inactive
#   f: A=+2, r=5   : L1=-10, L2=-2.56 -> -2.56 (clipped); no dual clip for A >= 0
#   two masked tokens (r=1, A=1)
RATIOS = [[1.5, 1.25, 0.7, 4.0], [1.1, 5.0, 1.0, 1.0]]
ADV = T([[1.0, 1.0, -1.0, -1.0], [-2.0, 2.0, 1.0, 1.0]])
PG_MASK = T([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
OLD = torch.zeros(2, 4)
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def _log_prob(requires_grad=False):
    return T([[math.log(r) for r in row] for row in RATIOS]).requires_grad_(requires_grad)


def test_policy_loss_token_mean_and_metrics():
    loss, metrics = compute_policy_loss(OLD, _log_prob(), ADV, PG_MASK, loss_agg_mode="token-mean", **CLIP)
    # (-1.28 - 1.25 + 0.8 + 3 + 2.2 - 2.56) / 6 = 0.91 / 6
    assert_close(loss, T(0.91 / 6))
    assert set(metrics) == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    assert_close(metrics["pg_clipfrac"], T(3.0 / 6))  # a, c, f
    assert_close(metrics["pg_clipfrac_lower"], T(1.0 / 6))  # d
    # ppo_kl = mean(old - logp) = -(ln1.5 + ln1.25 + ln0.7 + ln4 + ln1.1 + ln5) / 6
    expected_kl = -(math.log(1.5) + math.log(1.25) + math.log(0.7) + math.log(4) + math.log(1.1) + math.log(5)) / 6
    assert_close(metrics["ppo_kl"], T(expected_kl))


def test_policy_loss_seq_mean_token_mean():
    loss, _ = compute_policy_loss(OLD, _log_prob(), ADV, PG_MASK, loss_agg_mode="seq-mean-token-mean", **CLIP)
    # row 0: (-1.28 - 1.25 + 0.8 + 3) / 4 = 0.3175 ; row 1: (2.2 - 2.56) / 2 = -0.18 ; mean 0.06875
    assert_close(loss, T(0.06875))


def test_policy_loss_gradients_only_through_unclipped_tokens():
    log_prob = _log_prob(requires_grad=True)
    loss, metrics = compute_policy_loss(OLD, log_prob, ADV, PG_MASK, loss_agg_mode="token-mean", **CLIP)
    loss.backward()
    # d(-A r)/dlogp = -A r on unclipped tokens (b: -1.25, e: 2.2), 0 on clipped / dual-clipped / masked ; / 6 tokens
    assert_close(log_prob.grad, T([[0.0, -1.25 / 6, 0.0, 0.0], [2.2 / 6, 0.0, 0.0, 0.0]]))
    assert all(not m.requires_grad for m in metrics.values())


def test_policy_loss_clip_higher_asymmetry():
    # symmetric 0.2 (clip range [0.8, 1.2]): a -> -1.2, b (r=1.25) is now clipped -> -1.2, c 0.8, d 3, e 2.2,
    # f -> -2 * 1.2 = -2.4 ; (-1.2 - 1.2 + 0.8 + 3 + 2.2 - 2.4) / 6 = 1.2 / 6
    symmetric = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    loss, metrics = compute_policy_loss(OLD, _log_prob(), ADV, PG_MASK, loss_agg_mode="token-mean", **symmetric)
    assert_close(loss, T(1.2 / 6))
    assert_close(metrics["pg_clipfrac"], T(4.0 / 6))  # a, b, c, f


def test_policy_loss_dual_clip_only_for_negative_advantages():
    # A=-1, r=10: max(10, 1.28) = 10, capped to c = 3 ; same r with A=+1: max(-10, -1.28) = -1.28 (no cap)
    log_prob = T([[math.log(10.0), math.log(10.0)]])
    loss, metrics = compute_policy_loss(
        torch.zeros(1, 2), log_prob, T([[-1.0, 1.0]]), T([[1.0, 1.0]]), loss_agg_mode="seq-mean-token-sum", **CLIP
    )
    assert_close(loss, T(3.0 - 1.28))
    assert_close(metrics["pg_clipfrac_lower"], T(0.5))


def test_policy_loss_ratio_clamp():
    # log ratio 100 is clamped to 20 before exp ; A=+1 -> clipped branch -1.28 (no inf/nan)
    loss, metrics = compute_policy_loss(
        T([[0.0]]), T([[100.0]]), T([[1.0]]), T([[1.0]]), loss_agg_mode="token-mean", **CLIP
    )
    assert_close(loss, T(-1.28))
    assert_close(metrics["ppo_kl"], T(-20.0))


def test_policy_loss_rollout_is_weights_multiply_per_token():
    weights = T([[2.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0]])
    loss, _ = compute_policy_loss(
        OLD, _log_prob(), ADV, PG_MASK, loss_agg_mode="token-mean", rollout_is_weights=weights, **CLIP
    )
    # a: -1.28 * 2 = -2.56, e: 2.2 * 0.5 = 1.1 -> (-2.56 - 1.25 + 0.8 + 3 + 1.1 - 2.56) / 6 = -1.47 / 6
    assert_close(loss, T(-1.47 / 6))


def test_policy_loss_global_normalisers_and_scale_factor():
    loss, _ = compute_policy_loss(OLD, _log_prob(), ADV, PG_MASK, loss_agg_mode="token-mean", num_tokens=13, **CLIP)
    assert_close(loss, T(0.91 / 13))
    loss, _ = compute_policy_loss(
        OLD,
        _log_prob(),
        ADV,
        PG_MASK,
        loss_agg_mode="seq-mean-token-sum-norm",
        num_seqs=4,
        loss_scale_factor=2.0,
        **CLIP,
    )
    # sequence sums 1.27 and -0.36 -> 0.91 / 4 sequences / 2
    assert_close(loss, T(0.91 / 8))


def test_policy_loss_rejects_clip_ratio_c_at_most_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(
            OLD,
            _log_prob(),
            ADV,
            PG_MASK,
            loss_agg_mode="token-mean",
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
            clip_ratio_c=1.0,
        )


# ---------------------------------------------------------------- value loss


def test_value_loss_clipped_and_clipfrac():
    # cliprange 0.5:
    #   t1: v=1, old=0, R=2 -> clip(v) = 0.5 ; (1-2)^2 = 1, (0.5-2)^2 = 2.25 -> 2.25 (clipped)
    #   t2: v=1, old=0.8, R=1 -> clip(v) = 1 ; 0, 0 -> 0
    #   t3: v=0, old=1, R=0 -> clip(v) = 0.5 ; 0, 0.25 -> 0.25 (clipped)
    #   t4: v=3, old=0, R=0 -> clip(v) = 0.5 ; 9, 0.25 -> 9
    #   third column masked
    vpreds = T([[1.0, 1.0, 50.0], [0.0, 3.0, 50.0]])
    values = T([[0.0, 0.8, 0.0], [1.0, 0.0, 0.0]])
    returns = T([[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    vf_loss, clipfrac = compute_value_loss(
        vpreds, returns, values, mask.bool(), cliprange_value=0.5, loss_agg_mode="token-mean"
    )
    # 0.5 * (2.25 + 0 + 0.25 + 9) / 4 = 1.4375
    assert_close(vf_loss, T(1.4375))
    assert_close(clipfrac, T(0.5))
    vf_loss, _ = compute_value_loss(
        vpreds, returns, values, mask, cliprange_value=0.5, loss_agg_mode="seq-mean-token-sum", num_seqs=4
    )
    # 0.5 * ((2.25 + 0) + (0.25 + 9)) / 4 = 1.4375
    assert_close(vf_loss, T(1.4375))


# ---------------------------------------------------------------- logits helpers


def test_entropy_of_logit_rows():
    logits = T(
        [
            [0.0, 0.0, 0.0, 0.0],
            [math.log(1.0), math.log(3.0), -1e4, -1e4],
            [1000.0, 1000.0, -1e4, -1e4],
            [5.0, 5.0, 5.0, 5.0],
        ]
    )
    # uniform over 4 -> ln 4 ; p = (1/4, 3/4) -> -(0.25 ln 0.25 + 0.75 ln 0.75) ; huge equal pair -> ln 2 ; ln 4
    h13 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    expected = T([math.log(4), h13, math.log(2), math.log(4)])
    labels = torch.zeros(4, dtype=torch.long)
    assert_close(log_probs_and_entropy(logits.double(), labels)[1], expected.double())
    # float32: logits near 1000 have an ulp of ~6e-5, so only that precision is reachable, but no inf/nan
    assert_close(log_probs_and_entropy(logits, labels)[1], expected, atol=1e-4, rtol=0)


def test_log_probs_of_labels():
    logits = T([[math.log(1.0), math.log(3.0)], [0.0, 0.0], [1000.0, 0.0]])
    # ln(3/4) ; ln(1/2) ; 0 - logsumexp(1000, 0) = -1000
    log_probs, entropy = log_probs_and_entropy(logits, T([1, 0, 1]), with_entropy=False)
    assert_close(log_probs, T([math.log(0.75), math.log(0.5), -1000.0])) and entropy is None


@pytest.mark.parametrize("chunk_elements", [2**26, 7])  # one chunk; chunks of one row (7 < vocab 9)
def test_log_probs_and_entropy_and_their_gradients_equal_the_unfused_ones(monkeypatch, chunk_elements):
    monkeypatch.setattr("ppoflow.algorithms.losses.CHUNK_ELEMENTS", chunk_elements)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 9, generator=generator, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 9, (5,), generator=generator)
    weights = torch.randn(2, 5, generator=generator, dtype=torch.float64)  # any downstream use of both
    log_probs, entropy = log_probs_and_entropy(logits, labels)
    (weights[0] @ log_probs + weights[1] @ entropy).backward()
    fused = logits.grad.clone()
    logits.grad = None
    log_softmax = torch.log_softmax(logits, dim=-1)
    expected = (log_softmax.gather(-1, labels[:, None]).squeeze(-1), -(log_softmax.exp() * log_softmax).sum(-1))
    (weights[0] @ expected[0] + weights[1] @ expected[1]).backward()
    assert_close((log_probs, entropy), expected) and assert_close(fused, logits.grad)
    assert torch.autograd.gradcheck(lambda z: log_probs_and_entropy(z, labels), (logits.detach().requires_grad_(),))


def test_the_fused_pass_keeps_only_the_logits_for_the_backward_pass():
    """The log-softmax and the softmax of the unfused pair each kept another [tokens, vocab] tensor."""
    logits = torch.randn(64, 1000, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: kept.append(tensor.numel()) or tensor, lambda t: t):
        log_probs, entropy = log_probs_and_entropy(logits * 1.0, torch.zeros(64, dtype=torch.long))
    assert sorted(kept, reverse=True)[:2] == [64 * 1000, 64]  # the logits, then per-token values
