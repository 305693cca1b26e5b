"""The policy-loss registry (algorithms/policy_losses.py): each loss against its paper's formula on one tiny batch
worked by hand, under the aggregation modes, the mini-batch normalisers and the rollout-correction weights; a
user's loss from a file; and a run with a new loss replayed bit for bit from its step cache.

The batch: two sequences of three tokens, the second one's last token masked. Sequence 1 has advantage +1 and
token ratios r = pi / pi_old of 1.5, 1, 0.5; sequence 2 has advantage -2 and ratios 0.5, 1 (and 4, masked). The
current log-probs are -1, -2, -0.5 and -1.5, -0.5 (and -3). Clip range [0.8, 1.28] (clip_ratio_low 0.2,
clip_ratio_high 0.28) unless a test says otherwise. Tensors are float64; tolerance 1e-7 (verl adds 1e-8 to the
denominators of masked means and of per-sequence token means).
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from ppoflow.algorithms import policy_losses
from ppoflow.algorithms.losses import agg_loss
from ppoflow.algorithms.names import LOSS_AGG_MODES, POLICY_LOSSES
from ppoflow.algorithms.policy_losses import POLICY_LOSS_REGISTRY, policy_loss_fn
from ppoflow.configs import ConfigError, load_config
from ppoflow.configs.rules_policy_loss import configured_policy_loss
from tests.config_helpers import only_problem

T = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
RATIOS = T([[1.5, 1.0, 0.5], [0.5, 1.0, 4.0]])
LOG_PROB = T([[-1.0, -2.0, -0.5], [-1.5, -0.5, -3.0]])
OLD = LOG_PROB - RATIOS.log()
ADV = T([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
MASK = T([[1, 1, 1], [1, 1, 0]])
WEIGHTS = T([[1.0, 0.5, 2.0], [0.8, 1.0, 3.0]])
"""Rollout-correction (IS) weights; the last one is on the masked token."""
KL = -(math.log(1.5) + 2 * math.log(0.5)) / 5
"""``ppo_kl``: the mean of ``log pi_old - log pi`` over the five valid tokens."""
ACTOR_KEYS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0, "tau_neg": 1.05}


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def actor(**keys) -> object:
    """The actor section of a real config with ``ACTOR_KEYS`` and ``keys`` set (``policy_loss.x`` keys too)."""
    words = [f"actor_rollout_ref.actor.{key}={value}" for key, value in {**ACTOR_KEYS, **keys}.items()]
    return load_config("grpo_tiny", words).actor_rollout_ref.actor


def run(name: str, *, mode: str = "token-mean", config=None, weights=None, generator=None, **normalizers):
    """Loss ``name`` on the batch; returns the loss, its metrics as floats and d loss / d log_prob."""
    log_prob = LOG_PROB.clone().requires_grad_()
    loss, metrics = policy_loss_fn(name)(
        OLD,
        log_prob,
        ADV,
        MASK,
        loss_agg_mode=mode,
        config=config or actor(),
        rollout_is_weights=weights,
        generator=generator,
        **normalizers,
    )
    loss.backward()
    return loss.item(), {key: value.item() for key, value in metrics.items()}, log_prob.grad


def close(actual: float, expected: float, tol: float = 1e-7) -> None:
    assert actual == pytest.approx(expected, abs=tol, rel=tol)


def grad_close(actual: torch.Tensor, expected: list[list[float]], tol: float = 1e-7) -> None:
    torch.testing.assert_close(actual, T(expected), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------ the registry


def test_the_built_in_losses_are_registered_in_the_declared_order():
    assert tuple(POLICY_LOSS_REGISTRY)[: len(POLICY_LOSSES)] == POLICY_LOSSES


def test_an_unknown_loss_mode_is_a_config_error_naming_the_key_and_the_losses():
    key, message = only_problem(["actor_rollout_ref.actor.policy_loss.loss_mode=ppo2"])
    assert key == "actor_rollout_ref.actor.policy_loss.loss_mode"
    assert message.startswith("'ppo2' is not a policy loss; registered: " + ", ".join(POLICY_LOSSES))
    assert "loss_module" in message


def test_verls_policy_loss_keys_are_accepted():
    section = actor(**{"policy_loss.loss_mode": "kl_cov", "policy_loss.kl_cov_ratio": 0.01}).policy_loss
    assert (section.loss_mode, section.kl_cov_ratio, section.ppo_kl_coef) == ("kl_cov", 0.01, 0.1)  # verl's default
    assert (section.clip_cov_ratio, section.clip_cov_lb, section.clip_cov_ub) == (0.0002, 1.0, 5.0)
    key, _ = only_problem(["actor_rollout_ref.actor.policy_loss.clip_cov_ub=0.5"])
    assert key == "actor_rollout_ref.actor.policy_loss.clip_cov_ub"  # below clip_cov_lb = 1


# -------------------------------------------------------------------------------------------- the hand values


def test_vanilla_is_the_ppo_clip():
    # token losses max(-A r, -A clip(r)): -1.28 (clipped), -1, -0.5 | 1.6 (clipped), 2; dual-clip cap 6 not reached
    loss, metrics, grad = run("vanilla")
    close(loss, (-1.28 - 1 - 0.5 + 1.6 + 2) / 5)
    assert metrics == pytest.approx({"pg_clipfrac": 2 / 5, "ppo_kl": KL, "pg_clipfrac_lower": 0.0})
    grad_close(grad, [[0, -1 / 5, -0.5 / 5], [0, 2 / 5, 0]])  # d(-A r)/d log p = -A r; clipped tokens: 0
    close(run("vanilla", mode="seq-mean-token-mean")[0], ((-1.28 - 1 - 0.5) / 3 + (1.6 + 2) / 2) / 2)
    close(run("vanilla", weights=WEIGHTS)[0], (-1.28 * 1 - 1 * 0.5 - 0.5 * 2 + 1.6 * 0.8 + 2 * 1) / 5)


S1, S2 = 0.75 ** (1 / 3), 0.5**0.5
"""GSPO's sequence ratios: the geometric means (1.5 * 1 * 0.5)^(1/3) and (0.5 * 1)^(1/2)."""


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_clips_the_sequence_ratio_whatever_the_aggregation_mode(mode):
    # s1 = 0.9086 is inside [0.8, 1.28]: -A s1 on each token; s2 = 0.7071 < 0.8 with A < 0: 2 * 0.8, clipped
    loss, metrics, grad = run("gspo", mode=mode)
    close(loss, (-S1 + 1.6) / 2)  # always the mean over sequences of the token means (verl)
    assert metrics == pytest.approx({"pg_clipfrac": 2 / 5, "ppo_kl": KL, "pg_clipfrac_lower": 0.0})
    # each token of sequence 1 carries s1 * pi / sg[pi]: d/d log p = -A s1 / (3 tokens * 2 sequences)
    grad_close(grad, [[-S1 / 6] * 3, [0, 0, 0]])


def test_gspo_with_the_papers_clip_range_and_the_rollout_weights():
    # clip range [1 - 3e-4, 1 + 4e-4]: s1 < 1 - 3e-4 with A > 0 stays unclipped; s2 is clipped to 1 - 3e-4
    config = actor(clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    close(run("gspo", config=config)[0], (-S1 + 2 * (1 - 3e-4)) / 2)
    # the weights multiply each token: sequence means of the weights 3.5 / 3 and 0.9
    close(run("gspo", weights=WEIGHTS)[0], (-S1 * 3.5 / 3 + 1.6 * 0.9) / 2)


def test_cispo_weights_log_prob_by_the_detached_clipped_ratio():
    # -sg[clip(r)] * A * log p: clip(r) = 1.28, 1, 0.8 | 0.8, 1
    tokens = [[-1.28 * 1 * -1.0, -1.0 * 1 * -2.0, -0.8 * 1 * -0.5], [-0.8 * -2 * -1.5, -1.0 * -2 * -0.5]]
    loss, metrics, grad = run("cispo")
    close(loss, sum(map(sum, tokens)) / 5)
    assert metrics == pytest.approx({"pg_clipfrac": 3 / 5, "ppo_kl": KL, "pg_clipfrac_lower": 0.0})
    # the clipped tokens keep a gradient (vanilla's is 0 there), through log p only: -clip(r) * A / 5
    grad_close(grad, [[-1.28 / 5, -1 / 5, -0.8 / 5], [0.8 * 2 / 5, 2 / 5, 0]])
    close(run("cispo", mode="seq-mean-token-mean")[0], (sum(tokens[0]) / 3 + sum(tokens[1]) / 2) / 2)
    weighted = sum(t * w for row, ws in zip(tokens, WEIGHTS.tolist()) for t, w in zip(row, ws))
    loss, _, grad = run("cispo", weights=WEIGHTS)
    close(loss, weighted / 5)
    grad_close(grad, [[-1.28 / 5, -0.5 / 5, -1.6 / 5], [0.8 * 2 * 0.8 / 5, 2 / 5, 0]])


R1, R2 = math.exp((0.28 + math.log(0.5)) / 3), math.exp(-0.2 / 2)
"""GMPO's sequence ratios: sequence 1 (A > 0) clips its log-ratios from above at 0.28 (log 1.5 -> 0.28; log 0.5
stays), sequence 2 (A < 0) from below at -0.2 (log 0.5 -> -0.2; 0 stays)."""


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_geo_mean_is_the_geometric_mean_of_the_clipped_token_ratios(mode):
    loss, metrics, grad = run("geo_mean", mode=mode)
    close(loss, (-1 * R1 + 2 * R2) / 2)  # -A_i * ratio_i, averaged over the two sequences
    assert metrics == pytest.approx({"pg_clipfrac": 2 / 5, "ppo_kl": KL, "pg_clipfrac_lower": 1 / 5})
    # the log-ratios the clip did not replace (s1 t2, t3; s2 t2) carry -A * ratio_i / (tokens_i * 2 sequences)
    grad_close(grad, [[0, -R1 / 6, -R1 / 6], [0, 2 * R2 / 4, 0]])


def test_geo_mean_takes_the_geometric_mean_of_the_rollout_weights_and_the_sequence_normaliser():
    # per sequence (1 * 0.5 * 2)^(1/3) = 1 and (0.8 * 1)^(1/2) (verl adds 1e-10 inside the log)
    close(run("geo_mean", weights=WEIGHTS)[0], (-R1 + 2 * R2 * 0.8**0.5) / 2)
    close(run("geo_mean", num_seqs=4)[0], (-R1 + 2 * R2) / 4)


def test_sapo_replaces_the_clip_by_a_soft_gate():
    # -A * f(r), f = sigmoid(tau (r - 1)) * 4 / tau; tau = 1 where A > 0, 1.05 where A < 0
    gate = [[4 * sigmoid(0.5), 2.0, 4 * sigmoid(-0.5)], [4 / 1.05 * sigmoid(1.05 * -0.5), 2 / 1.05]]
    tokens = [[-g for g in gate[0]], [2 * g for g in gate[1]]]
    for mode in LOSS_AGG_MODES:  # always seq-mean-token-mean (verl)
        loss, metrics, grad = run("sapo", mode=mode)
        close(loss, (sum(tokens[0]) / 3 + sum(tokens[1]) / 2) / 2)
    assert metrics == pytest.approx({"pg_clipfrac": 0.0, "ppo_kl": KL, "pg_clipfrac_lower": 0.0})
    # d f / d log p = 4 sigmoid (1 - sigmoid) * r: at r = 1 it is 1, PPO's gradient on-policy
    d = lambda tau, r: 4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1))) * r  # noqa: E731
    grad_close(grad, [[-d(1, 1.5) / 6, -1 / 6, -d(1, 0.5) / 6], [2 * d(1.05, 0.5) / 4, 2 / 4, 0]])
    weighted = [[t * w for t, w in zip(row, ws)] for row, ws in zip(tokens, WEIGHTS.tolist())]
    close(run("sapo", weights=WEIGHTS)[0], (sum(weighted[0]) / 3 + sum(weighted[1][:2]) / 2) / 2)


# The covariance term (A - mean A)(log p - mean log p) over the five valid tokens: mean A = -0.2, mean log p = -1.1,
# so 1.2 * (0.1, -0.9, 0.6) = 0.12, -1.08, 0.72 | -1.8 * (-0.4, 0.6) = 0.72, -1.08.
PPO_CLIP_TOKENS = [[-1.28, -1.0, -0.5], [1.6, 2.0]]
"""The PPO clip's token losses (no dual clip), as in the vanilla test."""


def test_clip_cov_cuts_the_gradient_of_a_token_of_high_covariance():
    # candidates: not clipped by PPO (the first token of each sequence is) and lb 0.5 < cov < 5: only 0.72 (s1, t3)
    config = actor(**{"policy_loss.clip_cov_lb": 0.5})
    loss, metrics, grad = run("clip_cov", config=config)
    close(loss, (-1.28 - 1.0 + 0 + 1.6 + 2.0) / 5)
    assert metrics == pytest.approx({"pg_clipfrac": 1 / 5, "ppo_kl": KL})
    grad_close(grad, [[0, -1 / 5, 0], [0, 2 / 5, 0]])
    weighted = (-1.28 * 1 - 1.0 * 0.5 + 1.6 * 0.8 + 2.0 * 1) / 5
    close(run("clip_cov", config=config, weights=WEIGHTS)[0], weighted)
    close(run("clip_cov", config=config, mode="seq-mean-token-mean")[0], ((-1.28 - 1.0) / 3 + 3.6 / 2) / 2)
    # verl's bounds (1, 5) leave no candidate: the PPO clip alone
    loss, metrics, _ = run("clip_cov")
    close(loss, sum(map(sum, PPO_CLIP_TOKENS)) / 5)
    assert metrics["pg_clipfrac"] == 0.0


def test_clip_cov_draws_its_tokens_with_the_generator():
    # lb -2: three candidates (s1 t2 -1.08, s1 t3 0.72, s2 t2 -1.08); clip_cov_ratio 0.4 cuts int(0.4 * 5) = 2
    config = actor(**{"policy_loss.clip_cov_lb": -2.0, "policy_loss.clip_cov_ratio": 0.4})
    total = sum(map(sum, PPO_CLIP_TOKENS))
    pairs = {(-1.0, -0.5), (-1.0, 2.0), (-0.5, 2.0)}
    outcomes = {round((total - sum(pair)) / 5, 9) for pair in pairs}
    seen = set()
    for seed in range(12):
        loss, metrics, _ = run("clip_cov", config=config, generator=torch.Generator().manual_seed(seed))
        again, _, _ = run("clip_cov", config=config, generator=torch.Generator().manual_seed(seed))
        assert loss == again and metrics["pg_clipfrac"] == pytest.approx(2 / 5)
        seen.add(round(loss, 9))
    assert seen == outcomes  # every pair is drawn by some seed, and nothing else


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    # kl_cov_ratio 0.4: the int(0.4 * 5) = 2 largest terms, 0.72 at s1 t3 and s2 t1 (both |log r| = log 2), take
    # 0.1 * |log r| on top of the unclipped -A r: -1.5, -1, -0.5 | 1, 2
    config = actor(**{"policy_loss.kl_cov_ratio": 0.4})
    penalty = 0.1 * math.log(2)
    loss, metrics, grad = run("kl_cov", config=config)
    close(loss, (-1.5 - 1 - 0.5 + penalty + 1 + penalty + 2) / 5)
    assert metrics == pytest.approx({"ppo_kl": (math.log(1.5) + 2 * math.log(2)) / 5})  # the mean |log r|
    # d/d log p: -A r, plus 0.1 * sign(log r) = -0.1 on the two penalised tokens (both have r = 0.5)
    grad_close(grad, [[-1.5 / 5, -1 / 5, (-0.5 - 0.1) / 5], [(1.0 - 0.1) / 5, 2 / 5, 0]])
    close(
        run("kl_cov", config=config, mode="seq-mean-token-mean")[0],
        ((-1.5 - 1 - 0.5 + penalty) / 3 + (1 + penalty + 2) / 2) / 2,
    )
    weighted = (-1.5 * 1 - 1 * 0.5 + (-0.5 + penalty) * 2 + (1 + penalty) * 0.8 + 2 * 1) / 5
    close(run("kl_cov", config=config, weights=WEIGHTS)[0], weighted)


# --------------------------------------------------------------------------------- what every loss shares


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_every_loss_is_normalised_by_the_mini_batch_and_ignores_masked_tokens(name):
    """Twice the tokens and sequences in the whole mini-batch halve a micro-batch's loss (so micro-batch losses
    add up to the mini-batch's); a masked token's values change nothing."""
    config = actor(**{"policy_loss.clip_cov_lb": 0.5})
    loss = run(name, config=config)[0]
    close(run(name, config=config, num_tokens=10.0, num_seqs=4.0)[0], loss / 2)
    log_prob = LOG_PROB.clone()
    log_prob[1, 2] = 5.0
    other, _ = policy_loss_fn(name)(OLD, log_prob, ADV, MASK, loss_agg_mode="token-mean", config=config)
    close(other.item(), loss)


# ----------------------------------------------------------------------------------------- a user's own loss

USER_LOSS = """
from ppoflow.algorithms.losses import agg_loss
from ppoflow.algorithms.policy_losses import register_policy_loss
import torch


@register_policy_loss("reinforce")
def reinforce(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, config, rollout_is_weights=None,
              generator=None, **normalizers):
    return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode, **normalizers), {"marker": torch.tensor(7.0)}
"""


@pytest.fixture
def user_loss(tmp_path, monkeypatch):
    """A file registering ``reinforce``; the registry is restored afterwards."""
    monkeypatch.setattr(policy_losses, "POLICY_LOSS_REGISTRY", dict(POLICY_LOSS_REGISTRY))
    path = tmp_path / "my_losses.py"
    path.write_text(textwrap.dedent(USER_LOSS))
    return [
        f"actor_rollout_ref.actor.policy_loss.loss_module={path}",
        "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce",
    ]


def test_a_users_loss_registers_from_its_file(user_loss):
    section = load_config("grpo_tiny", user_loss).actor_rollout_ref.actor
    fn = configured_policy_loss(section.policy_loss)
    loss, metrics = fn(OLD, LOG_PROB, ADV, MASK, loss_agg_mode="token-mean", config=section)
    close(loss.item(), -(1 * (-1 - 2 - 0.5) + -2 * (-1.5 - 0.5)) / 5)  # -A log p over the five tokens
    assert metrics["marker"].item() == 7.0


def test_a_loss_mode_the_file_does_not_register_or_a_file_that_fails_is_named(user_loss, tmp_path):
    key, message = only_problem([user_loss[0], "actor_rollout_ref.actor.policy_loss.loss_mode=reinforce2"])
    assert key == "actor_rollout_ref.actor.policy_loss.loss_mode"
    assert message == "'reinforce2' is not a policy loss; registered: " + ", ".join((*POLICY_LOSSES, "reinforce"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no')\n")
    key, message = only_problem([f"actor_rollout_ref.actor.policy_loss.loss_module={broken}", user_loss[1]])
    assert key == "actor_rollout_ref.actor.policy_loss.loss_module"
    assert message == f"cannot import {str(broken)!r}: RuntimeError: no"
    with pytest.raises(ConfigError, match="'reinforce3' is not a policy loss"):  # as the worker reports it
        configured_policy_loss(actor().policy_loss.model_copy(update={"loss_mode": "reinforce3"}))


@pytest.fixture
def cfg(tiny_overrides, user_loss):
    return load_config("grpo_tiny", tiny_overrides + user_loss)


def test_the_actor_trains_with_the_configured_loss(cfg, prompts):
    """The worker imports the loss's file itself (a Ray worker is a process of its own) and trains with it:
    its pg_loss is -A log p, token-mean over the batch, at the update's own log-probs."""
    from ppoflow.workers.rollout.hf_worker import HFRolloutWorker
    from ppoflow.workers.rollout.sampling import SamplingParams
    from ppoflow.workers.training.policy import ActorWorker

    policy_losses.POLICY_LOSS_REGISTRY.pop("reinforce")  # as in a fresh process
    actor = ActorWorker(cfg)
    batch = HFRolloutWorker(cfg).generate(prompts, step=1, sampling=SamplingParams.for_training(cfg))
    log_probs = actor.compute_log_prob(batch)["log_probs"]
    batch["advantages"] = torch.linspace(-1, 1, batch.batch_size[0]).unsqueeze(1).expand_as(log_probs).clone()
    metrics = actor.update(batch, step=1).metrics  # on-policy: its own log-probs are the old ones
    assert metrics["actor/marker"] == 7.0
    expected = agg_loss(-batch["advantages"] * log_probs, batch["response_mask"], "token-mean")
    assert metrics["actor/pg_loss"] == pytest.approx(expected.item(), abs=1e-6)


# ------------------------------------------------------------------------------------------------ replay


REPLAYED_LOSSES = [
    pytest.param(name, words, marks=pytest.mark.slow)
    for name, words in [
        ("gspo", []),
        ("cispo", []),
        ("geo_mean", []),
        ("sapo", []),
        ("clip_cov", ["actor_rollout_ref.actor.policy_loss.clip_cov_lb=-100"]),  # a token cut in every micro-batch
        ("kl_cov", []),
    ]
]
"""Each new loss in a run (~14 s each), with the slow tests; by default each loss's values are checked above and
the actor trains with one (test_the_actor_trains_with_the_configured_loss)."""


@pytest.mark.parametrize(("name", "words"), REPLAYED_LOSSES)
def test_a_run_with_a_new_loss_replays_bit_for_bit(prefect_api, ray_local, tiny_model, tmp_path, name, words):
    """The loss over two PPO epochs (so the ratios leave 1) in a run that caches its steps; a second run replays
    them from the cache: the same update metrics, bit for bit."""
    from tests.conftest import REPLAY_EPOCHS
    from tests.flow_runs import UPDATE_METRICS, rollout_skip, small, train

    words = small(tmp_path, tiny_model) + [
        REPLAY_EPOCHS,
        f"actor_rollout_ref.actor.policy_loss.loss_mode={name}",
        *words,
    ]
    dump = tmp_path / "dump"
    skip = {
        **rollout_skip(dump, [1, 2]),
        "reward.enable": "true",
        "reward.dump_dir": str(dump),
        "reward.steps": "[1,2]",
    }
    recorded, states = train(words, tmp_path / "record", 2, skip)
    assert states == ["Completed"] * 2
    replayed, states = train(words, tmp_path / "replay", 2, skip)
    assert states == ["Cached"] * 2
    assert [row["actor/ppo_kl"] != 0 for row in recorded] == [True, True]  # the second epoch moved the ratios
    compared = [metric for metric in UPDATE_METRICS if metric in recorded[0]]  # kl_cov has no pg_clipfrac
    assert "actor/pg_loss" in compared and "actor/grad_norm" in compared
    for before, after in zip(recorded, replayed, strict=True):
        for metric in compared:
            assert before[metric] == after[metric], (metric, before["step"])
